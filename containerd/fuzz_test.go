package containerd_test

import (
	"errors"
	"testing"

	"github.com/containerd/containerd/api/events"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
)

// FuzzConverter feeds the converter what a daemon (or anything on its
// socket) could send: any type URL with any bytes. It must return a typed
// event with a key, or an error the monitor drops with a reason; never panic.
// Whether it decodes a URL it has learned or asks typeurl, the outcome must
// be typeurl's own.
func FuzzConverter(f *testing.F) {
	for _, e := range []any{
		&events.TaskExit{ContainerID: "c1", ExitStatus: 137},
		&events.ImageDelete{Name: "docker.io/library/busybox:latest"},
		&events.SnapshotCommit{Key: "k", Name: "n"},
	} {
		payload, err := typeurl.MarshalAnyToProto(e)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(payload.GetTypeUrl(), payload.GetValue())
	}
	f.Add("containerd.events.TaskExit", []byte{0xff, 0xff})
	f.Add("", []byte(nil))
	f.Fuzz(func(t *testing.T, typeURL string, value []byte) {
		key, event, err := containerd.Converter().Convert(&anypb.Any{TypeUrl: typeURL, Value: value})
		want, wantErr := typeurl.UnmarshalByTypeURL(typeURL, value)
		if wantErr != nil && err == nil {
			t.Fatalf("typeurl fails with %v, the converter gives %v", wantErr, event)
		}
		if wantMsg, ok := want.(proto.Message); ok && wantErr == nil && err == nil && !proto.Equal(wantMsg, event.(proto.Message)) {
			t.Fatalf("typeurl gives %v, the converter %v", want, event)
		}
		if err != nil {
			if !errors.Is(err, eventmonitor.ErrUnsupportedEvent) && !errors.Is(err, eventmonitor.ErrDecode) {
				t.Fatalf("error of no known kind: %v", err)
			}
			return
		}
		if event == nil {
			t.Fatalf("no event and no error for %q (key %q)", typeURL, key)
		}
	})
}
