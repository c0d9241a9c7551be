package eventmonitor

// Review 19: failing tests of the changes since 8530651.

import (
	"context"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// Shutdown waits for the stream reader to see intake end, queueing what it
// takes until then. A Stop begun while it waits, with nothing queued and no
// call running but the reader holding an envelope, drops that envelope
// (ErrStopped) though Shutdown was to queue and drain it. Shutdown must
// report the Stop that cut it short, as it does when the lost work was
// queued (TestShutdownReportsAStopBegunWhileItWaitedForTheReader); it
// returns nil, as if its drain were done.
func TestShutdownReportsAStopThatDroppedTheEnvelopeInHand(t *testing.T) {
	entered, converting := make(chan struct{}), make(chan struct{})
	conv := ConverterFunc(func(typeurl.Any) (string, any, error) {
		close(entered)
		<-converting
		return "r", ev{"r", 0}, nil
	})
	h := newHarness(t, newRecorder(), WithConverter(conv))
	ch := make(chan *Envelope, 1)
	ch <- &Envelope{Topic: "/t", Event: payload(t, wrapperspb.String("r"))}
	h.m.Subscribe(SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) { return ch, nil }))
	h.m.Start()
	<-entered // the reader holds an envelope: Shutdown waits for it

	shut := shutdownBegun(t, h, context.Background())
	stopped := make(chan struct{})
	go func() { defer close(stopped); h.m.Stop() }()
	waitFor(t, h.stopping, "Stop began")
	close(converting) // the envelope is refused: Stop and Shutdown go on
	<-stopped
	err := <-shut

	reason, ok := dropReason(h, ev{"r", 0})
	require.True(t, ok, "the envelope in hand was dropped by the Stop: %+v", h.drops.all())
	require.ErrorIs(t, reason, ErrStopped)
	require.ErrorIs(t, err, ErrStopped,
		"Shutdown was to queue and drain r/0, which the Stop dropped, yet it returned %v", err)
	assertBalanced(t, h.m.Stats())
}

// Shutdown with a ctx already ended, on a monitor with nothing to drain,
// loses nothing: its drain is done before it begins, and it should return
// nil, as it did before it stopped starting a drain for an ended ctx
// (93d4c35). It returns ctx's error, whose message says the shutdown was
// cut short.
func TestShutdownWithAnEndedCtxOnAnEmptyMonitorReturnsNil(t *testing.T) {
	h := newHarness(t, newRecorder())
	h.submit(t, ev{"a", 1})
	h.settled(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.NoError(t, h.m.Shutdown(ctx), "nothing was queued, running or in backoff: nothing was lost")
	require.Empty(t, h.drops.all())
}

// A call Stop withdraws before its handler began is never made (the
// progress CAS), but its drop still says the handler was running: here a
// replay's call waits in its retry log line (user code, before the CAS)
// when Shutdown's ctx has ended, and a/1 is dropped as "handler still
// running when Shutdown's ctx ended, abandoned", though the handler was
// never called for it again. The drop blames a running handler, which
// TestShutdownWithAnEndedCtxStartsNoCall calls wrong for an event that
// was waiting in backoff.
func TestAWithdrawnCallsDropDoesNotBlameARunningHandler(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithBackoff(time.Second, time.Minute))
	hook := newBlockHook(logrus.InfoLevel, "retrying backed-off events")
	h.m.cfg.logger.Logger.AddHook(hook)
	defer close(hook.release)
	r.fail(ev{"a", 1}, 1)
	h.submit(t, ev{"a", 1})
	h.settled(t) // a/1 failed once: in backoff, due in a second
	require.Equal(t, 1, r.callCount())
	h.clock.Step(time.Second)
	<-hook.blocked // the replay's call was taken; its goroutine logs the retry

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, h.m.Shutdown(ctx), context.Canceled)
	reason, ok := dropReason(h, ev{"a", 1})
	require.True(t, ok, "a/1 dropped: %+v", h.drops.all())
	require.ErrorIs(t, reason, ErrStopped)
	assert.Equal(t, 1, r.callCount(), "the withdrawn call was made")
	assert.NotContains(t, reason.Error(), "still running",
		"a/1's handler never began: its call was withdrawn, not abandoned while running")
}
