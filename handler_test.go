package eventmonitor

import (
	"context"
	"errors"
	"testing"

	"github.com/sirupsen/logrus"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestMuxRoutesByType(t *testing.T) {
	var got []string
	mux := NewMux()
	On(mux, func(ctx context.Context, e ev) error { got = append(got, "ev "+e.String()); return nil })
	On(mux, func(ctx context.Context, e *exitEvent) error {
		got = append(got, "exit "+e.Key)
		return errors.New("x")
	})

	require.NoError(t, mux.HandleEvent(context.Background(), ev{"a", 1}))
	require.Error(t, mux.HandleEvent(context.Background(), &exitEvent{Key: "c"}))
	require.ErrorIs(t, mux.HandleEvent(context.Background(), exitEvent{Key: "value, not pointer"}), ErrUnsupportedEvent,
		"unrouted types are not the handler's")
	require.ErrorIs(t, mux.HandleEvent(context.Background(), nil), ErrUnsupportedEvent)
	assert.Equal(t, []string{"ev a/1", "exit c"}, got)
}

// An event the Mux has no route for is ignored, and its type logged once at
// debug level with the event's key, so that a forgotten On shows in the log.
func TestMuxLogsAnUnroutedTypeOnce(t *testing.T) {
	mux := NewMux()
	On(mux, func(context.Context, ev) error { return nil })
	h := newHarness(t, mux)
	for key, event := range map[string]any{"a": exitEvent{}, "b": exitEvent{}, "c": ev{"c", 1}, "d": &exitEvent{}} {
		require.NoError(t, h.m.Submit(key, event))
	}
	h.settled(t)
	assert.Equal(t, uint64(3), h.m.Stats().Ignored)
	const line = "ignoring events of a type the Mux has no route for; logged once per type"
	entries := h.entries(line)
	require.Len(t, entries, 2, "one line per type")
	assert.Equal(t, logrus.DebugLevel, entries[0].Level)
	types := []any{entries[0].Data["type"], entries[1].Data["type"]}
	assert.ElementsMatch(t, []string{"eventmonitor.exitEvent", "*eventmonitor.exitEvent"}, types)
	assert.Contains(t, []any{"a", "b", "d"}, entries[0].Data["key"], "with the event's key")
}
