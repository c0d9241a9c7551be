package eventmonitor_test

// The stream: Subscribe and Start, Run, the resync hook, and what intake
// does with each envelope it reads.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/eventmonitor/eventmonitor"
)

// streamConverter makes ev{key, seq} of the envelopes streamEnvelope makes,
// so that the recorder can gate and fail them; it keeps keyConverter's
// errors.
var streamConverter = eventmonitor.ConverterFunc(func(p typeurl.Any) (string, any, error) {
	_, v, err := keyConverter.Convert(p)
	if err != nil {
		return "", nil, err
	}
	s := v.(*wrapperspb.StringValue).GetValue()
	i := strings.LastIndexByte(s, '/')
	seq, _ := strconv.Atoi(s[i+1:])
	return s[:i], ev{s[:i], seq}, nil
})

// streamEnvelope carries e in namespace "ns", for streamConverter.
func streamEnvelope(t *testing.T, e ev) *eventmonitor.Envelope {
	return envelope(t, "ns", e.String())
}

// streamSend delivers envelopes of e on st, failing t if st ends first.
func streamSend(t *testing.T, st stream, events ...any) {
	t.Helper()
	for _, e := range events {
		select {
		case st.ch <- streamEnvelope(t, e.(ev)):
		case <-st.ctx.Done():
			t.Fatalf("the subscription ended before %v was delivered", e)
		}
	}
}

// streamRecv waits for what ch delivers.
func streamRecv[T any](t *testing.T, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatal("nothing delivered")
		var zero T
		return zero
	}
}

// streamResult waits for what Start's channel delivers: the error, or open
// false if it closed without one; with atOnce, it must be there already.
func streamResult(t *testing.T, ch <-chan error, atOnce bool) (err error, open bool) {
	t.Helper()
	if atOnce {
		select {
		case err, open = <-ch:
			return err, open
		default:
			t.Fatal("nothing delivered at once")
		}
	}
	select {
	case err, open = <-ch:
		return err, open
	case <-time.After(10 * time.Second):
		t.Fatal("the channel neither delivered nor closed")
		return nil, false
	}
}

// streamLines counts the log lines with msg.
func streamLines(h *harness, msg string) (n int) {
	for _, e := range h.logs.AllEntries() {
		if e.Message == msg {
			n++
		}
	}
	return n
}

const (
	streamBroke   = "event stream broke; re-subscribing"
	streamRefused = "re-subscribing failed; trying again"
)

// streamAwaitResubscribe waits until Run has logged its n-th re-subscribe
// delay and waits it on the clock, checks that the delay is want, and
// steps the clock through it, checking that it waits until the end. Stream
// tests set no handle timeout, so Run's delay is the clock's one waiter.
func streamAwaitResubscribe(t *testing.T, h *harness, n int, want time.Duration) {
	t.Helper()
	waitFor(t, "Run to wait to re-subscribe", func() bool {
		return streamLines(h, streamBroke)+streamLines(h, streamRefused) == n && h.clk.HasWaiters()
	})
	var last any
	for _, e := range h.logs.AllEntries() {
		if e.Message == streamBroke || e.Message == streamRefused {
			last = e.Data["delay"]
		}
	}
	require.Equal(t, want, last, "re-subscribe delay %d", n)
	h.clk.Step(want - time.Nanosecond)
	require.True(t, h.clk.HasWaiters(), "re-subscribed before %v", want)
	h.clk.Step(time.Nanosecond)
}

func TestStartReadsTheSubscribedStream(t *testing.T) {
	broken := errors.New("rpc error: Unavailable")
	for _, tc := range []struct {
		name string
		end  func(st stream)
		want error // nil: any error
	}{
		{"stream error", func(st stream) { st.errs <- broken }, broken},
		{"envelope channel closed", func(st stream) { close(st.ch) }, nil},
		{"error channel closed", func(st stream) { close(st.errs) }, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, eventmonitor.WithConverter(streamConverter), eventmonitor.WithHandleTimeout(0))
			sub := newFakeSubscriber(0)
			var filters []string
			h.m.Subscribe(eventmonitor.SubscriberFunc(func(ctx context.Context, f ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
				filters = f
				return sub.Subscribe(ctx, f...)
			}), `topic~="/tasks/"`)
			require.Equal(t, []string{`topic~="/tasks/"`}, filters)
			errCh := h.m.Start()
			st := sub.next(t)
			streamSend(t, st, evs("a", 1, 2)...)
			streamSend(t, st, evs("b", 1)...)
			waitFor(t, "three envelopes received", func() bool { return h.m.Stats().Received == 3 })
			h.settle(t)
			require.Equal(t, evs("a", 1, 2), h.rec.handled("a"), "in order per key")
			require.Equal(t, evs("b", 1), h.rec.handled("b"))

			tc.end(st)
			err, open := streamResult(t, errCh, false)
			require.True(t, open, "the stream's end is delivered before the channel closes")
			require.Error(t, err)
			if tc.want != nil {
				require.Equal(t, tc.want, err)
			}
			_, open = streamResult(t, errCh, false)
			require.False(t, open, "the channel closes after the stream's error")
			require.True(t, h.logged("event stream failed", ""))
			require.NoError(t, h.m.Submit("c", ev{"c", 1}), "a broken stream does not stop the monitor")
		})
	}
}

// Whether the subscriber closes its channels as its ctx ends (containerd's
// does) or not, and whichever the reader sees first.
func TestStartsChannelClosesEmptyAtStopAndShutdown(t *testing.T) {
	for _, stop := range []string{"Stop", "Shutdown"} {
		for _, closes := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/closes %v", stop, closes), func(t *testing.T) {
				for range 5 {
					h := newHarness(t, nil, eventmonitor.WithConverter(streamConverter))
					sub := newFakeSubscriber(0)
					h.m.Subscribe(sub)
					errCh := h.m.Start()
					st := sub.next(t)
					if closes {
						go func() { <-st.ctx.Done(); close(st.errs); close(st.ch) }()
					}
					if stop == "Stop" {
						h.m.Stop()
					} else {
						require.NoError(t, h.m.Shutdown(context.Background()))
					}
					err, open := streamResult(t, errCh, false)
					require.False(t, open, "Start's channel delivered %v", err)
					awaitClosed(t, st.ctx.Done(), "the subscription to end")
				}
			})
		}
	}
}

// Start's channel delivers the refusal at once, then closes, and ends the
// subscription; Run returns it without subscribing.
func TestStartAndRunRefuseAtOnce(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, h *harness)
		want  error
	}{
		{"no converter", nil, eventmonitor.ErrInvalidOption},
		{"after Stop", func(_ *testing.T, h *harness) { h.m.Stop() }, eventmonitor.ErrStopped},
		{"after Shutdown", func(t *testing.T, h *harness) { require.NoError(t, h.m.Shutdown(context.Background())) },
			eventmonitor.ErrStopped},
		{"while Run reads", func(t *testing.T, h *harness) {
			sub := newFakeSubscriber(0)
			runMonitor(t, h.m, sub)
			sub.next(t)
		}, eventmonitor.ErrAlreadyRunning},
		{"while Start reads", func(t *testing.T, h *harness) {
			sub := newFakeSubscriber(0)
			h.m.Subscribe(sub)
			h.m.Start()
			sub.next(t)
		}, eventmonitor.ErrAlreadyRunning},
	} {
		for _, reader := range []string{"Start", "Run"} {
			t.Run(tc.name+"/"+reader, func(t *testing.T) {
				var opts []eventmonitor.Option
				if tc.setup != nil {
					opts = append(opts, eventmonitor.WithConverter(streamConverter))
				}
				h := newHarness(t, nil, opts...)
				if tc.setup != nil {
					tc.setup(t, h)
				}
				sub := newFakeSubscriber(0)
				if reader == "Run" {
					require.ErrorIs(t, h.m.Run(context.Background(), sub), tc.want)
					require.Empty(t, sub.streams, "a refused Run subscribed")
					return
				}
				h.m.Subscribe(sub)
				errCh := h.m.Start()
				err, open := streamResult(t, errCh, true)
				require.True(t, open)
				require.ErrorIs(t, err, tc.want)
				_, open = streamResult(t, errCh, false)
				require.False(t, open, "the channel closes after the error")
				awaitClosed(t, sub.next(t).ctx.Done(), "the refused subscription to end")
			})
		}
	}
}

func TestBareStartClosesWhenStopIsDone(t *testing.T) {
	var hs *harness
	entered, release := make(chan struct{}), make(chan struct{})
	hs = newHarness(t, eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		close(entered)
		<-release // ignores its ctx: Stop waits for it
		return hs.rec.HandleEvent(ctx, e)
	}), eventmonitor.WithHandleTimeout(0))
	lifetime := hs.m.Start()
	hs.submit(t, ev{"a", 1})
	<-entered
	select {
	case <-lifetime:
		t.Fatal("a bare Start's channel closed while the monitor runs")
	default:
	}
	stopped := make(chan struct{})
	go func() { hs.m.Stop(); close(stopped) }()
	waitFor(t, "Stop to begin", func() bool { return hs.m.Submit("probe", ev{"probe", 1}) != nil })
	select {
	case <-lifetime:
		t.Fatal("a bare Start's channel closed before Stop was done")
	default:
	}
	close(release)
	awaitClosed(t, stopped, "Stop")
	err, open := streamResult(t, lifetime, true)
	require.False(t, open, "delivered %v", err)
}

func TestStartAndRunEndTheDeferredHold(t *testing.T) {
	for _, how := range []string{"bare Start", "Subscribe and Start", "Run"} {
		t.Run(how, func(t *testing.T) {
			h := newHarness(t, nil, eventmonitor.WithDeferredStart(), eventmonitor.WithConverter(streamConverter))
			h.submit(t, ev{"a", 1})
			h.settle(t)
			require.Empty(t, h.rec.handled(), "a held monitor handles nothing")
			sub := newFakeSubscriber(0)
			switch how {
			case "bare Start":
				h.m.Start()
			case "Subscribe and Start":
				h.m.Subscribe(sub)
				h.m.Start()
			case "Run":
				runMonitor(t, h.m, sub)
			}
			waitFor(t, "a/1 handled", func() bool { return len(h.rec.handled()) == 1 })
		})
	}
}

func TestRunResubscribesWithBackoff(t *testing.T) {
	resynced := make(chan struct{}, 8)
	h := newHarness(t, nil, eventmonitor.WithConverter(streamConverter), eventmonitor.WithHandleTimeout(0),
		eventmonitor.WithResubscribe(100*time.Millisecond, 500*time.Millisecond),
		eventmonitor.WithResync(func(context.Context) error { resynced <- struct{}{}; return nil }))
	sub := newFakeSubscriber(1)
	runMonitor(t, h.m, sub)
	for i, s := range []struct {
		established string // "", or how the subscription is
		delay       time.Duration
	}{
		{"", 100}, {"", 200}, {"", 400}, {"", 500}, {"", 500}, // refused at once: doubles up to max
		{"delivers", 100}, {"", 200}, // reset
		{"not refused within the initial delay", 100}, // reset
	} {
		st := sub.next(t)
		switch s.established {
		case "delivers":
			streamSend(t, st, ev{"a", i})
			streamRecv(t, resynced)
		case "not refused within the initial delay":
			waitFor(t, "the establishing timer", h.clk.HasWaiters)
			h.clk.Step(100 * time.Millisecond)
			streamRecv(t, resynced)
		}
		st.errs <- errors.New("connection refused")
		streamAwaitResubscribe(t, h, i+1, s.delay*time.Millisecond)
	}
	sub.next(t)
	require.Equal(t, 2, streamLines(h, streamBroke), "a warning per established stream that broke")
	require.Equal(t, 6, streamLines(h, streamRefused), "a debug line per refused attempt")
}

func TestRunReturnsWhenItsCtxEndsOrTheMonitorStops(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  func(h *harness, cancel context.CancelFunc)
		want error
	}{
		{"ctx ends", func(_ *harness, cancel context.CancelFunc) { cancel() }, nil},
		{"Stop", func(h *harness, _ context.CancelFunc) { h.m.Stop() }, eventmonitor.ErrStopped},
		{"Shutdown", func(h *harness, _ context.CancelFunc) { _ = h.m.Shutdown(context.Background()) }, eventmonitor.ErrStopped},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, eventmonitor.WithConverter(streamConverter), eventmonitor.WithHandleTimeout(0))
			sub := newFakeSubscriber(0)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ran := make(chan error, 1)
			go func() { ran <- h.m.Run(ctx, sub) }()
			st := sub.next(t)
			tc.end(h, cancel)
			require.ErrorIs(t, streamRecv(t, ran), tc.want) // nil only if it is
			awaitClosed(t, st.ctx.Done(), "the subscription to end")
			if tc.want != nil {
				return
			}
			// Returning did not stop the monitor: it handles, and reads again.
			h.submit(t, ev{"a", 1})
			runMonitor(t, h.m, sub)
			streamSend(t, sub.next(t), ev{"b", 1})
			waitFor(t, "both handled", func() bool { return len(h.rec.handled()) == 2 })
		})
	}
}

// The hook runs on the first subscription too, once per established
// subscription, beside the reading, with a ctx that ends with it; refused
// attempts neither resync nor count as outages.
func TestRunResyncsOnEachEstablishedSubscription(t *testing.T) {
	resyncs := make(chan context.Context, 8)
	h := newHarness(t, nil, eventmonitor.WithConverter(streamConverter), eventmonitor.WithHandleTimeout(0),
		eventmonitor.WithResubscribe(100*time.Millisecond, time.Second),
		eventmonitor.WithResync(func(ctx context.Context) error {
			resyncs <- ctx
			<-ctx.Done() // resyncs as long as the subscription lasts
			return ctx.Err()
		}))
	sub := newFakeSubscriber(1)
	runMonitor(t, h.m, sub)

	st := sub.next(t)
	waitFor(t, "the establishing timer", h.clk.HasWaiters)
	require.Empty(t, resyncs, "a resync before the subscription is established")
	h.clk.Step(100 * time.Millisecond) // not refused within the initial delay: established
	first := streamRecv(t, resyncs)
	streamSend(t, st, ev{"a", 1})
	waitFor(t, "a/1 handled while the hook runs", func() bool { return len(h.rec.handled()) == 1 })
	require.NoError(t, first.Err())
	require.Zero(t, h.m.Stats().Resubscribed, "the first subscription is no re-subscription")

	// An outage: two attempts refused at once, then one that delivers.
	st.errs <- errors.New("daemon gone")
	awaitClosed(t, first.Done(), "the hook's ctx to end with its subscription")
	streamAwaitResubscribe(t, h, 1, 100*time.Millisecond)
	for i, d := range []time.Duration{200, 400} {
		sub.next(t).errs <- errors.New("connection refused")
		streamAwaitResubscribe(t, h, 2+i, d*time.Millisecond)
	}
	require.Empty(t, resyncs, "a refused subscription resynced")
	st = sub.next(t)
	streamSend(t, st, ev{"a", 2})
	second := streamRecv(t, resyncs)
	waitFor(t, "a/2 handled", func() bool { return len(h.rec.handled()) == 2 })
	require.Equal(t, uint64(1), h.m.Stats().Resubscribed, "one outage, however many attempts")
	require.Empty(t, resyncs, "resynced twice for one subscription")
	st.errs <- errors.New("daemon gone again")
	awaitClosed(t, second.Done(), "the second hook's ctx")
	require.False(t, h.logged("resync after subscribing failed", ""), "a hook ended by its ctx is no failure")
}

func TestStreamFiltersOtherNamespaces(t *testing.T) {
	h := newHarness(t, nil, eventmonitor.WithConverter(streamConverter), eventmonitor.WithNamespace("k8s.io"))
	sub := newFakeSubscriber(8)
	runMonitor(t, h.m, sub)
	st := sub.next(t)
	for _, ns := range []string{"default", "moby", "default", "k8s.io"} {
		st.ch <- envelope(t, ns, ns+"/1")
	}
	waitFor(t, "the last handled", func() bool { return len(h.rec.handled()) == 1 }) // the others read before it
	require.Equal(t, []any{ev{"k8s.io", 1}}, h.rec.handled())
	s := h.m.Stats()
	require.Equal(t, uint64(3), s.Filtered)
	requireBalanced(t, s)
	var lines []string
	for _, e := range h.logs.AllEntries() {
		if e.Data["namespace"] != nil && strings.HasPrefix(e.Message, "ignoring events of another namespace") {
			require.Equal(t, logrus.DebugLevel, e.Level)
			lines = append(lines, e.Data["namespace"].(string))
		}
	}
	require.Equal(t, []string{"default", "moby"}, lines, "logged once per namespace")
}

func TestStreamIgnoresTypesWithNoKey(t *testing.T) {
	h := newHarness(t, nil, eventmonitor.WithConverter(streamConverter))
	sub := newFakeSubscriber(8)
	runMonitor(t, h.m, sub)
	st := sub.next(t)
	unkeyed, err := typeurl.MarshalAny(wrapperspb.Int64(3))
	require.NoError(t, err)
	unknown := &anypb.Any{TypeUrl: "example.com/no.such.Event", Value: []byte{1}}
	for _, p := range []typeurl.Any{unkeyed, unknown, unkeyed, unknown} {
		st.ch <- &eventmonitor.Envelope{Namespace: "ns", Topic: "/t", Event: p}
	}
	st.ch <- streamEnvelope(t, ev{"a", 1})
	waitFor(t, "the last handled", func() bool { return len(h.rec.handled()) == 1 }) // the others read before it
	require.Equal(t, []any{ev{"a", 1}}, h.rec.handled())
	s := h.m.Stats()
	require.Equal(t, uint64(4), s.Ignored)
	require.Zero(t, s.Dropped, "an ignored type is not dropped")
	requireBalanced(t, s)
	var types []string
	for _, e := range h.logs.AllEntries() {
		if strings.HasPrefix(e.Message, "ignoring events of a type the converter has no key for") {
			require.Equal(t, logrus.DebugLevel, e.Level)
			types = append(types, e.Data["type"].(string))
		}
	}
	require.Equal(t, []string{unkeyed.GetTypeUrl(), unknown.GetTypeUrl()}, types, "logged once per type")
}

func TestStreamDropsEnvelopesThatMakeNoEvent(t *testing.T) {
	good := streamEnvelope(t, ev{"k", 1})
	good.Topic = "/t"
	with := func(p typeurl.Any) *eventmonitor.Envelope {
		return &eventmonitor.Envelope{Namespace: "ns", Topic: "/t", Event: p}
	}
	returning := func(key string, event any, err error) eventmonitor.Converter {
		return eventmonitor.ConverterFunc(func(typeurl.Any) (string, any, error) { return key, event, err })
	}
	panicking := eventmonitor.ConverterFunc(func(typeurl.Any) (string, any, error) { panic("bad key") })
	invalid := eventmonitor.ErrInvalidEvent
	for _, tc := range []struct {
		name   string
		conv   eventmonitor.Converter
		env    *eventmonitor.Envelope
		want   error
		events []any
	}{
		{"undecodable bytes", streamConverter, with(&anypb.Any{TypeUrl: good.Event.GetTypeUrl(), Value: []byte{0xff}}),
			eventmonitor.ErrDecode, nil},
		{"converter error", returning("k", ev{"k", 1}, errors.New("bad bytes")), good, eventmonitor.ErrDecode, nil},
		{"nil payload", streamConverter, with(nil), invalid, nil},
		{"nil envelope", streamConverter, nil, invalid, nil},
		{"nil event", returning("k", nil, nil), good, invalid, nil},
		{"empty key", returning("", ev{"", 1}, nil), good, invalid, []any{ev{"", 1}}},
		{"converter panic", panicking, good, invalid, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, eventmonitor.WithConverter(tc.conv))
			sub := newFakeSubscriber(1)
			runMonitor(t, h.m, sub)
			sub.next(t).ch <- tc.env
			waitFor(t, "the drop", func() bool { return len(h.drops.list()) == 1 })
			d := h.drops.list()[0]
			require.ErrorIs(t, d.Reason, tc.want)
			require.Equal(t, tc.events, d.Events)
			if tc.env != nil {
				require.Equal(t, [2]string{"/t", "ns"}, [2]string{d.Topic, d.Namespace}, "the envelope's origin")
			}
			h.settle(t)
			require.Empty(t, h.rec.log())
			s := h.m.Stats()
			require.Equal(t, uint64(1), s.Dropped)
			requireBalanced(t, s)
		})
	}
}

func TestIntakeLimitPausesReading(t *testing.T) {
	var hs *harness
	var maxQueued atomic.Int64
	hs = newHarness(t, eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		if q := int64(hs.m.Stats().Queued); q > maxQueued.Load() {
			maxQueued.Store(q)
		}
		return hs.rec.HandleEvent(ctx, e)
	}), eventmonitor.WithConverter(streamConverter), eventmonitor.WithIntakeLimit(2), eventmonitor.WithHandleTimeout(0))
	started, release := hs.rec.gate(ev{"a", 0})
	t.Cleanup(release)
	sub := newFakeSubscriber(10)
	runMonitor(t, hs.m, sub)
	st := sub.next(t)
	streamSend(t, st, ev{"a", 0})
	streamSend(t, st, evs("b", 1, 2, 3, 4, 5, 6, 7, 8, 9)...)
	<-started

	paused := func(received uint64, left int) {
		t.Helper()
		waitFor(t, "the reader to pause", func() bool {
			s := hs.m.Stats()
			return s.Received == received && s.Queued == 2
		})
		require.GreaterOrEqual(t, len(st.ch), left, "read on past the limit: %+v", hs.m.Stats())
	}
	paused(3, 6) // a/0 runs; b/1 and b/2 wait: no room
	require.Equal(t, evs("b", 1, 2), hs.m.Forget("b"))
	paused(5, 4) // room for two more
	release()
	waitFor(t, "everything read", func() bool { return hs.m.Stats().Received == 10 })
	hs.settle(t)
	require.Equal(t, append([]any{ev{"a", 0}}, evs("b", 3, 4, 5, 6, 7, 8, 9)...), hs.rec.handled())
	require.LessOrEqual(t, maxQueued.Load(), int64(2))
	requireBalanced(t, hs.m.Stats())
}

// Envelopes a subscription delivered into its channel before Stop or
// Shutdown are read, whatever held the reader back (here the intake
// limit): Received, then handled or dropped, never left unread.
func TestBufferedEnvelopesAreNeverLost(t *testing.T) {
	const n = 14
	for _, reader := range []string{"Start", "Run"} {
		for _, stop := range []string{"Stop", "Shutdown"} {
			t.Run(reader+"/"+stop, func(t *testing.T) {
				h := newHarness(t, nil, eventmonitor.WithConverter(streamConverter), eventmonitor.WithIntakeLimit(1),
					eventmonitor.WithHandleTimeout(0))
				started, release := h.rec.gate(ev{"k", 0})
				t.Cleanup(release)
				sub := newFakeSubscriber(n)
				if reader == "Start" {
					h.m.Subscribe(sub)
					h.m.Start()
				} else {
					runMonitor(t, h.m, sub)
				}
				st := sub.next(t)
				all := evs("k", 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)
				streamSend(t, st, all...)
				<-started
				waitFor(t, "the reader held at the limit", func() bool { return h.m.Stats().Queued == 1 })

				stopped := make(chan error, 1)
				go func() {
					if stop == "Stop" {
						h.m.Stop()
						stopped <- nil
					} else {
						stopped <- h.m.Shutdown(context.Background())
					}
				}()
				awaitClosed(t, st.ctx.Done(), "intake to end")
				release()
				require.NoError(t, streamRecv(t, stopped))

				s := h.m.Stats()
				requireBalanced(t, s)
				require.Equal(t, uint64(n), s.Received, "every envelope delivered is received: %+v", s)
				require.Empty(t, st.ch)
				if stop == "Shutdown" {
					require.Equal(t, all, h.rec.handled(), "Shutdown handles all, in order")
					require.Empty(t, h.drops.list())
					return
				}
				got := h.rec.handled()
				for _, e := range h.drops.events() {
					require.ErrorIs(t, h.drops.reason(e), eventmonitor.ErrStopped)
					got = append(got, e)
				}
				require.ElementsMatch(t, all, got, "each handled or dropped, once")
			})
		}
	}
}

// A subscriber may buffer envelopes and then fail (containerd's does): the
// reader takes them before it reports the error or re-subscribes.
func TestStreamErrorIngestsBufferedEnvelopesFirst(t *testing.T) {
	const n = 8
	buffered := func() (<-chan *eventmonitor.Envelope, <-chan error) {
		ch, errs := make(chan *eventmonitor.Envelope, n), make(chan error, 1)
		for i := range n {
			ch <- streamEnvelope(t, ev{"k", i})
		}
		errs <- errors.New("rpc error: Unavailable")
		close(errs)
		close(ch)
		return ch, errs
	}
	t.Run("Start", func(t *testing.T) {
		h := newHarness(t, nil, eventmonitor.WithConverter(streamConverter))
		h.m.Subscribe(eventmonitor.SubscriberFunc(func(context.Context, ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
			return buffered()
		}))
		err, open := streamResult(t, h.m.Start(), false)
		require.True(t, open)
		require.EqualError(t, err, "rpc error: Unavailable")
		require.Equal(t, uint64(n), h.m.Stats().Received, "read before the error was reported")
		h.settle(t)
		require.Len(t, h.rec.handled(), n)
	})
	t.Run("Run", func(t *testing.T) {
		h := newHarness(t, nil, eventmonitor.WithConverter(streamConverter), eventmonitor.WithHandleTimeout(0))
		resubscribed := make(chan uint64, 1)
		subscribed := 0
		runMonitor(t, h.m, eventmonitor.SubscriberFunc(func(ctx context.Context, _ ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
			if subscribed++; subscribed == 1 {
				return buffered()
			}
			resubscribed <- h.m.Stats().Received
			return make(chan *eventmonitor.Envelope), make(chan error)
		}))
		waitFor(t, "Run to wait to re-subscribe", func() bool {
			return streamLines(h, streamBroke)+streamLines(h, streamRefused) == 1 && h.clk.HasWaiters()
		})
		h.clk.Step(100 * time.Millisecond)
		select {
		case received := <-resubscribed:
			require.Equal(t, uint64(n), received, "re-subscribed before reading what was buffered")
		case <-time.After(10 * time.Second):
			t.Fatal("Run did not re-subscribe")
		}
	})
}

// A subscription whose envelopes came with its error delivered them: it was
// established, so it counts as a re-subscription, and the stream's break
// resets the re-subscribe delay.
func TestASubscriptionThatDeliveredIsEstablished(t *testing.T) {
	resynced := make(chan struct{}, 4)
	h := newHarness(t, nil, eventmonitor.WithConverter(streamConverter), eventmonitor.WithHandleTimeout(0),
		eventmonitor.WithResubscribe(100*time.Millisecond, time.Second),
		eventmonitor.WithResync(func(context.Context) error { resynced <- struct{}{}; return nil }))
	sub := newFakeSubscriber(4)
	runMonitor(t, h.m, sub)
	st := sub.next(t)
	streamSend(t, st, ev{"a", 1})
	streamRecv(t, resynced) // established
	st.errs <- errors.New("daemon restarted")
	streamAwaitResubscribe(t, h, 1, 100*time.Millisecond)
	sub.next(t).errs <- errors.New("connection refused")
	streamAwaitResubscribe(t, h, 2, 200*time.Millisecond)

	st = sub.next(t)
	streamSend(t, st, evs("a", 2, 3)...)
	st.errs <- errors.New("daemon restarted again") // at once: the reader may see it first
	streamAwaitResubscribe(t, h, 3, 100*time.Millisecond)
	require.Equal(t, 2, streamLines(h, streamBroke), "an established stream broke")
	require.Equal(t, uint64(1), h.m.Stats().Resubscribed)
	waitFor(t, "all handled", func() bool { return len(h.rec.handled()) == 3 })
}

// A handler call's ctx carries the Timestamp of the envelope its event came
// in, on a retry too; an event given to Submit has none.
func TestHandlersSeeTheirEnvelopesTimestamp(t *testing.T) {
	seen := make(chan [2]any, 8) // the event, and its ctx's timestamp (nil: none)
	var h *harness
	h = newHarness(t, eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		var stamp any
		if at, ok := eventmonitor.TimestampFromContext(ctx); ok {
			stamp = at
		}
		seen <- [2]any{e, stamp}
		return h.rec.HandleEvent(ctx, e)
	}), eventmonitor.WithConverter(streamConverter), eventmonitor.WithHandleTimeout(0))
	sub := newFakeSubscriber(4)
	runMonitor(t, h.m, sub)
	st := sub.next(t)
	h.rec.fail(ev{"a", 1}, 1)
	published := epoch.Add(-time.Minute)
	env := streamEnvelope(t, ev{"a", 1})
	env.Timestamp = published
	st.ch <- env
	waitFor(t, "the envelope received", func() bool { return h.m.Stats().Received == 1 })
	h.step(t, time.Minute) // the retry
	h.submit(t, ev{"b", 1})
	h.settle(t)

	want := [][2]any{{ev{"a", 1}, published}, {ev{"a", 1}, published}, {ev{"b", 1}, nil}}
	for _, w := range want {
		require.Equal(t, w, streamRecv(t, seen))
	}
	_, ok := eventmonitor.TimestampFromContext(context.Background())
	require.False(t, ok, "outside a handler call")
}
