package fakecontainerd

import (
	"testing"
	"time"

	"github.com/containerd/containerd/api/events"
	"github.com/stretchr/testify/assert"
)

func TestFilterSyntax(t *testing.T) {
	env := envelope("k8s.io", "/tasks/exit", time.Unix(0, 0), mustAny(&events.TaskExit{ContainerID: "c1", ExitStatus: 137}))
	for _, tc := range []struct {
		filter string
		match  bool
	}{
		{``, true},
		{`topic=="/tasks/exit"`, true},
		{`topic~=/tasks/`, true}, // /…/ quotes, so this is the regexp "tasks"
		{`topic==/tasks/`, false},
		{`topic~=|^/tasks/e|`, true},
		{`topic~="^/images/"`, false},
		{`namespace==k8s.io, topic~=exit`, true},
		{`namespace==k8s.io,topic~=create`, false},
		{`namespace!=default`, true},
		{`event.container_id==c1`, true},
		{`event.exit_status==137`, false}, // containerd adapts string fields only
		{`event.id`, false},               // present only when set
		{`event`, false},
	} {
		f, err := parseFilters([]string{tc.filter})
		if assert.NoError(t, err, tc.filter) {
			assert.Equal(t, tc.match, f.match(envelopeFields(env)), tc.filter)
		}
	}
	for _, bad := range []string{`topic==`, `topic=/x`, `topic~="("`, `a==b,`, `"unterminated`, `a==b c`, `topic==/tasks/exit`} {
		_, err := parseFilters([]string{bad})
		assert.Error(t, err, bad)
	}
	obj := fields(map[string]string{"runtime.name": "runc"}, map[string]string{"io.k8s.pod": "p"})
	for flt, match := range map[string]bool{`labels."io.k8s.pod"==p`: true, `labels.io.k8s.pod`: true, `labels.pod`: false, `runtime.name~=^ru`: true} {
		f, err := parseFilters([]string{flt})
		if assert.NoError(t, err, flt) {
			assert.Equal(t, match, f.match(obj), flt)
		}
	}
}
