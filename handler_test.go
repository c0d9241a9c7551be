package eventmonitor

import (
	"context"
	"errors"
	"testing"

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
