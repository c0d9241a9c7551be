package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor/internal/keyq"
)

func TestNewRejectsInvalidOptions(t *testing.T) {
	for name, opt := range map[string]Option{
		"zero initial":        WithBackoff(0, time.Second),
		"negative max":        WithBackoff(time.Second, -1),
		"initial above max":   WithBackoff(time.Minute, time.Second),
		"jitter above 1":      WithJitter(1.5),
		"negative jitter":     WithJitter(-0.1),
		"zero workers":        WithWorkers(0),
		"negative timeout":    WithHandleTimeout(-1),
		"negative attempts":   WithMaxAttempts(-1),
		"negative queue":      WithMaxQueuedPerKey(-1),
		"zero intake":         WithIntakeLimit(0),
		"resubscribe inverse": WithResubscribe(time.Minute, time.Second),
		"nil clock":           WithClock(nil),
		"typed nil clock":     WithClock((*testclock.FakeClock)(nil)), // it once panicked under mu at the first Submit
		"typed nil metrics":   WithMetrics((*recordedMetrics)(nil)),
		"nil logger":          WithLogger(nil),
	} {
		t.Run(name, func(t *testing.T) {
			m, err := New(HandlerFunc(func(context.Context, any) error { return nil }), opt)
			require.ErrorIs(t, err, ErrInvalidOption)
			assert.Nil(t, m)
		})
	}
	_, err := New(nil)
	require.ErrorIs(t, err, ErrInvalidOption)

	_, err = New(newRecorder(), WithWorkers(0), WithJitter(2))
	require.ErrorContains(t, err, "WithWorkers(0)")
	require.ErrorContains(t, err, "WithJitter(2)", "every invalid option is reported, by its name")
}

func TestSubmitRejectsBadInput(t *testing.T) {
	h := newHarness(t, newRecorder())
	require.ErrorIs(t, h.m.Submit("", ev{}), ErrInvalidEvent)
	require.ErrorIs(t, h.m.Submit(string(make([]byte, MaxKeyLength+1)), ev{}), ErrInvalidEvent)
	require.ErrorIs(t, h.m.Submit("a", nil), ErrInvalidEvent)
	assert.Zero(t, h.m.Stats().Received, "refused events are not counted as received")
}

func TestSlowKeyDoesNotDelayOthers(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithWorkers(4))
	started, release := r.gate(ev{"slow", 1})
	defer release()
	h.submit(t, ev{"slow", 1})
	<-started
	h.submit(t, ev{"slow", 2})
	var others []ev
	for i := range 50 {
		others = append(others, ev{fmt.Sprintf("k%d", i%10), i})
	}
	h.submit(t, others...)
	waitFor(t, func() bool { return len(r.handledList()) == len(others) }, "other keys must not wait for the slow one")
	assert.NotContains(t, r.handledList(), ev{"slow", 2}, "slow/2 must wait for slow/1")
	release()
	waitFor(t, func() bool { return len(r.handledList()) == len(others)+2 }, "slow key finishes")
}

// A key with a backlog goes to the back of the run queue after each event,
// so another key waits for one event of it, not for its whole backlog.
func TestBusyKeyTakesTurns(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r) // one worker
	started, release := r.gate(ev{"busy", 0})
	h.submit(t, ev{"busy", 0})
	<-started
	const backlog = 100
	for i := 1; i <= backlog; i++ {
		h.submit(t, ev{"busy", i})
	}
	h.submit(t, ev{"other", 0})
	release()
	h.settled(t)

	handled := r.handledList()
	require.Len(t, handled, backlog+2)
	assert.Equal(t, 1, slices.Index(handled, any(ev{"other", 0})), "the other key runs right after the busy key's event")
}

func TestNoKeyRunsTwiceAtOnce(t *testing.T) {
	const keys, perKey = 20, 40
	r := newRecorder()
	rng := rand.New(rand.NewPCG(1, 2))
	var rngMu sync.Mutex
	r.onCall = func(ctx context.Context, e any) error {
		rngMu.Lock()
		fail := rng.IntN(10) < 3
		rngMu.Unlock()
		if fail {
			return errors.New("flaky")
		}
		return nil
	}
	h := newHarness(t, r, WithWorkers(4), WithBackoff(time.Second, 4*time.Second))

	var wg sync.WaitGroup
	for g := range 4 { // keys split over 4 submitting goroutines
		wg.Add(1)
		go func() {
			defer wg.Done()
			for s := range perKey {
				for k := g; k < keys; k += 4 {
					key := fmt.Sprintf("k%d", k)
					if s%10 == 9 { // some arrive as exits, handled inline
						exitCh := make(chan fakeExit, 1)
						exitCh <- fakeExit{code: uint32(s)}
						<-WatchExit(context.Background(), h.m, key, exitCh, func(uint32, time.Time) any { return ev{key, s} })
						continue
					}
					assert.NoError(t, h.m.Submit(key, ev{key, s}))
				}
			}
		}()
	}
	wg.Wait()
	for h.m.Stats().Handled < keys*perKey {
		h.settled(t)
		h.clock.Step(4 * time.Second)
	}

	r.mu.Lock()
	defer r.mu.Unlock()
	for key, n := range r.maxConc {
		assert.Equal(t, 1, n, "key %s ran %d calls at once", key, n)
	}
	// Successful handling per key follows acceptance order.
	next := map[string]int{}
	for _, e := range r.handled {
		e := e.(ev)
		require.Equal(t, next[e.Key], e.Seq, "key %s out of order", e.Key)
		next[e.Key]++
	}
	assert.Len(t, r.handled, keys*perKey)
}

func TestHandlerContextHasClockDrivenDeadline(t *testing.T) {
	got := make(chan error, 1)
	var deadline time.Time
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		deadline, _ = ctx.Deadline()
		<-ctx.Done()
		got <- ctx.Err()
		return ctx.Err()
	}), WithHandleTimeout(3*time.Second))
	require.NoError(t, h.m.Submit("a", ev{"a", 1}))
	waitFor(t, func() bool { return h.m.Stats().InFlight == 1 }, "call starts")
	h.clock.Step(3*time.Second - time.Nanosecond)
	select {
	case err := <-got:
		t.Fatalf("ctx ended before its deadline: %v", err)
	default:
	}
	h.clock.Step(time.Nanosecond)
	require.ErrorIs(t, <-got, context.DeadlineExceeded)
	assert.Equal(t, epoch.Add(3*time.Second), deadline)
}

// A call starts as its worker takes its event: a replay's log line, written
// before the handler is called, counts in the deadline (WithHandleTimeout),
// so a log hook that takes 3 s leaves the handler 7 s of 10.
func TestAReplaysDeadlineCountsItsLogLine(t *testing.T) {
	deadlines := make(chan time.Time, 2)
	var calls atomic.Int32
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		deadline, _ := ctx.Deadline()
		deadlines <- deadline
		if calls.Add(1) == 1 {
			return errors.New("the first call fails")
		}
		return nil
	}), WithHandleTimeout(10*time.Second), WithBackoff(time.Second, time.Minute))
	hook := newBlockHook(logrus.InfoLevel, "retrying backed-off events")
	h.m.cfg.logger.Logger.AddHook(hook)
	require.NoError(t, h.m.Submit("a", ev{"a", 1}))
	h.settled(t)
	require.Equal(t, epoch.Add(10*time.Second), <-deadlines)
	h.clock.Step(time.Second) // the replay is taken at 1 s; its log line takes until 4 s
	<-hook.blocked
	h.clock.Step(3 * time.Second)
	close(hook.release)
	h.settled(t)
	assert.Equal(t, epoch.Add(11*time.Second), <-deadlines, "7 s left when the handler began")
}

// A handler's context ends when the handler returns, as one from
// context.WithTimeout with a deferred cancel would: work the handler started
// with it stops too.
func TestHandlerContextEndsWhenTheCallReturns(t *testing.T) {
	contexts := make(chan context.Context, 2)
	watched := make(chan struct{})
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		contexts <- ctx
		if e.(ev).Seq == 1 {
			go func() { // outlives the call
				<-ctx.Done()
				close(watched)
			}()
		}
		return ctx.Err()
	}))
	h.submit(t, ev{"a", 1}, ev{"a", 2})
	h.settled(t)
	assert.EqualValues(t, 2, h.m.Stats().Handled, "the context was live during each call")
	for range 2 {
		ctx := <-contexts
		assert.ErrorIs(t, ctx.Err(), context.Canceled)
		select {
		case <-ctx.Done():
		default:
			t.Fatal("Done is not closed after the call returned")
		}
	}
	select {
	case <-watched:
	case <-time.After(10 * time.Second):
		t.Fatal("a goroutine watching the call's context was never released")
	}
}

// Done asked for while the call returns (from a goroutine the handler
// started) must still close: the context's end and the channel's creation
// race without a lock.
func TestHandlerContextDoneRacesTheReturn(t *testing.T) {
	const calls = 500
	var released sync.WaitGroup
	released.Add(calls)
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		go func() {
			<-ctx.Done()
			released.Done()
		}()
		return nil
	}), WithWorkers(4))
	for i := range calls {
		h.submit(t, ev{fmt.Sprintf("k%d", i%20), i})
	}
	waitDone := make(chan struct{})
	go func() {
		released.Wait()
		close(waitDone)
	}()
	select {
	case <-waitDone:
	case <-time.After(10 * time.Second):
		t.Fatal("a goroutine waiting on a finished call's context was never released")
	}
}

func TestPanicIsAFailure(t *testing.T) {
	calls := 0
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		calls++
		if calls == 1 {
			panic("boom")
		}
		return nil
	}))
	require.NoError(t, h.m.Submit("a", ev{"a", 1}))
	h.settled(t)
	assert.True(t, h.m.InBackoff("a"), "the panic sends the event to backoff")
	assert.Equal(t, uint64(1), h.m.Stats().Failed)
	assert.True(t, h.logged("event handler panicked", "a"))
	h.step(t, time.Second)
	assert.Equal(t, uint64(1), h.m.Stats().Handled, "the retry succeeds")
}

func TestMaxAttemptsGivesUpAndGoesOn(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithMaxAttempts(2))
	r.fail(ev{"a", 1}, 10)
	h.submit(t, evs("a", 1, 2)...)
	h.step(t, time.Second)
	assert.Equal(t, anys(ev{"a", 2}), r.handledList(), "a/2 handled after a/1 is given up")
	drops := h.drops.all()
	require.Len(t, drops, 1)
	assert.ErrorIs(t, drops[0].Reason, ErrMaxAttempts)
	assert.Equal(t, anys(ev{"a", 1}), drops[0].Events)
	assert.False(t, h.m.InBackoff("a"), "a leaves backoff")
}

// A key whose event is given up on goes on only once the drop handler has
// had the drop: its next event is not handled before, while other keys
// are. So it is with Metrics (the report path), and when the drop handler
// ends the worker's goroutine. White-box: the key's queue.
func TestAKeyWaitsForItsDropToBeHandedOver(t *testing.T) {
	for _, tc := range []struct {
		name            string
		metrics, goexit bool
	}{{"plain", false, false}, {"metrics", true, false}, {"goexit", false, true}} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRecorder()
			r.fail(ev{"a", 1}, 1)
			inDrop, release := make(chan struct{}), make(chan struct{})
			var drops atomic.Int32
			opts := []Option{WithMaxAttempts(1), WithWorkers(2), WithLogger(quietLogger()), WithDropHandler(func(Drop) {
				if drops.Add(1) == 1 {
					close(inDrop)
					<-release
					if tc.goexit {
						runtime.Goexit()
					}
				}
			})}
			if tc.metrics {
				opts = append(opts, WithMetrics(noopMetrics{}))
			}
			h := newHarness(t, r, opts...)
			h.submit(t, ev{"a", 1}, ev{"a", 2}, ev{"b", 1})
			<-inDrop
			waitFor(t, func() bool { return len(r.handledOf("b")) == 1 }, "b/1 handled on the other worker")
			h.m.mu.Lock() // a/2 would have been taken before the drop handler was called
			k := h.m.keys.Get("a")
			waiting := k != nil && k.Len() == 1
			h.m.mu.Unlock()
			assert.True(t, waiting, "a/2 waits for a/1's drop")
			close(release)
			h.settled(t)
			assert.Equal(t, anys(ev{"a", 2}), r.handledOf("a"))
			assertBalanced(t, h.m.Stats())
		})
	}
}

func TestMaxQueuedPerKeyRefusesOverflow(t *testing.T) {
	h := newHarness(t, newRecorder(), WithMaxQueuedPerKey(2))
	h.m.Backoff("a", ev{"a", 1})
	require.NoError(t, h.m.Submit("a", ev{"a", 2}))
	require.ErrorIs(t, h.m.Submit("a", ev{"a", 3}), ErrQueueFull)
	h.m.Backoff("a", ev{"a", 4})
	drops := h.drops.all()
	require.Len(t, drops, 1, "Backoff has no caller to refuse to: it drops")
	assert.ErrorIs(t, drops[0].Reason, ErrQueueFull)
}

func TestStatsAccountForEveryEvent(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithWorkers(2))
	r.fail(ev{"b", 1}, 1)
	h.submit(t, ev{"a", 1}, ev{"b", 1}, ev{"c", 1})
	h.m.Backoff("d", ev{"d", 1})
	h.settled(t)
	s := h.m.Stats()
	assert.Equal(t, Stats{Received: 4, Handled: 2, Failed: 1, KeysInBackoff: 2, EventsInBackoff: 2}, s)
	assert.Len(t, h.m.Pending(), 2)
}

// An idle key is forgotten at once: a node's churn of short-lived
// containers must not grow the monitor's memory, and a key that comes back
// starts afresh.
func TestIdleKeysAreForgotten(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithWorkers(2), WithBackoff(time.Second, time.Minute))
	const total = 3000
	for i := range total {
		h.submit(t, ev{fmt.Sprintf("c%d", i), 0})
	}
	h.settled(t)
	require.Len(t, r.handledList(), total)
	h.m.mu.Lock()
	known := 0
	h.m.keys.Keys(func(*keyq.Key[item]) { known++ })
	h.m.mu.Unlock()
	assert.Zero(t, known, "no idle key is kept")

	r.fail(ev{"c0", 1}, 1)
	h.submit(t, ev{"c0", 1})
	h.settled(t)
	require.Len(t, h.m.Pending(), 1)
	assert.Equal(t, 1, h.m.Pending()[0].Attempts)
	assert.Equal(t, epoch.Add(time.Second), h.m.Pending()[0].Due, "it waits the initial delay")
	h.step(t, time.Second)
	assert.Len(t, r.handledList(), total+1)
}

type bigEvent struct {
	key string
	seq int
	_   [1 << 16]byte // big enough that the collector frees it promptly
}

// collected runs the collector until the finalizer behind done ran.
func collected(done *atomic.Bool) bool {
	for range 5 {
		runtime.GC()
		runtime.GC() // the first queues the finalizer, the second lets it run
		if done.Load() {
			return true
		}
	}
	return false
}

// A key's queue is a plain slice: an event handled (or popped into a call)
// must not stay reachable through the key's array while the key stays
// busy, nor after a failure put it back with slices.Insert.
func TestPoppedEventsAreNotRetained(t *testing.T) {
	gates := map[int]chan struct{}{}
	started := map[int]chan struct{}{}
	for i := 1; i <= 6; i++ {
		gates[i], started[i] = make(chan struct{}), make(chan struct{})
	}
	var failOnce sync.Once
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		seq := e.(*bigEvent).seq
		select {
		case <-started[seq]:
		default:
			close(started[seq])
		}
		<-gates[seq]
		if seq == 2 {
			var err error
			failOnce.Do(func() { err = errors.New("once") })
			return err
		}
		return nil
	}), WithBackoff(time.Second, time.Minute))
	t.Cleanup(func() {
		for _, g := range gates {
			select {
			case <-g:
			default:
				close(g)
			}
		}
	})
	ptrs := make([]*atomic.Bool, 6)
	for i := 1; i <= 6; i++ {
		e := &bigEvent{key: "k", seq: i}
		done := new(atomic.Bool)
		runtime.SetFinalizer(e, func(*bigEvent) { done.Store(true) })
		ptrs[i-1] = done
		require.NoError(t, h.m.Submit("k", e))
	}
	<-started[1]
	close(gates[1])
	<-started[2]
	assert.True(t, collected(ptrs[0]), "event 1, handled, still reachable while its key is busy")
	close(gates[2]) // fails: back at the head with slices.Insert, the key waits
	h.settled(t)
	require.Equal(t, 5, h.m.Stats().EventsInBackoff)
	h.clock.Step(time.Second) // replay: 2 succeeds now, 3 blocks
	<-started[3]
	assert.True(t, collected(ptrs[1]), "event 2, failed then handled, still reachable")
	close(gates[3])
	<-started[4]
	assert.True(t, collected(ptrs[2]), "event 3 still reachable")
	for i := 4; i <= 6; i++ {
		close(gates[i])
	}
	h.settled(t)
	for i, p := range ptrs {
		assert.True(t, collected(p), "event %d still reachable once its key is idle", i+1)
	}
	assertBalanced(t, h.m.Stats())
}

// A context the handler derives from its ctx (containerd's handlers wrap
// shim calls in context.WithTimeout(ctx, ...)) ends at the call's
// deadline: its Err is Canceled, copied by the standard library from the
// cancel context inside the call, and its Cause DeadlineExceeded, as the
// Handler doc says.
func TestDerivedContextEndsAtTheDeadline(t *testing.T) {
	got, derived := make(chan [2]error, 1), make(chan struct{})
	h := newHarness(t, HandlerFunc(func(ctx context.Context, _ any) error {
		child, cancel := context.WithCancel(ctx)
		defer cancel()
		close(derived)
		<-child.Done()
		got <- [2]error{child.Err(), context.Cause(child)}
		return nil
	}), WithHandleTimeout(10*time.Second))
	require.NoError(t, h.m.Submit("a", ev{"a", 1}))
	<-derived
	h.clock.Step(10 * time.Second)
	select {
	case errs := <-got:
		require.ErrorIs(t, errs[0], context.Canceled)
		require.ErrorIs(t, errs[1], context.DeadlineExceeded)
	case <-time.After(10 * time.Second):
		t.Fatal("the derived context never ended")
	}
}

// The handler's ctx.Err never changes once non-nil: read racing the
// deadline, it is DeadlineExceeded from the first, never Canceled then
// DeadlineExceeded (it once read the cause before the error).
func TestErrAtTheDeadlineIsNeverCanceledFirst(t *testing.T) {
	const rounds = 30
	var mu sync.Mutex
	var firsts []error
	running := make(chan struct{}, 1)
	h := newHarness(t, HandlerFunc(func(ctx context.Context, _ any) error {
		running <- struct{}{}
		var first error
		for first == nil {
			first = ctx.Err()
		}
		mu.Lock()
		firsts = append(firsts, first)
		mu.Unlock()
		return nil
	}), WithHandleTimeout(time.Second))
	for i := range rounds {
		require.NoError(t, h.m.Submit("a", ev{"a", i}))
		<-running
		waitArmed(t, h.m, func(time.Time) bool { return true })
		h.clock.Step(time.Second)
		h.settled(t)
	}
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, firsts, rounds)
	for i, err := range firsts {
		require.ErrorIs(t, err, context.DeadlineExceeded, "round %d: the first non-nil Err at the deadline", i)
	}
}

// nilPtrErr is an error type whose Error dereferences its receiver.
type nilPtrErr struct{ msg string }

func (e *nilPtrErr) Error() string { return e.msg }

// bomb is an error whose Error panics with a bomb: fmt, printing the
// recovered value, panics again.
type bomb struct{}

func (bomb) Error() string { panic(bomb{}) }

type bombStatus struct{}

func (bombStatus) Result() (uint32, time.Time, error) { return 0, time.Time{}, bomb{} }

// formatBomb is an error whose Error is fine but whose Format panics with a
// bomb: checked only calls Error, and logrus's text formatter prints the
// error with fmt, which calls Format and re-panics on the nested panic.
type formatBomb struct{}

func (formatBomb) Error() string          { return "fine" }
func (formatBomb) Format(fmt.State, rune) { panic(bomb{}) }
func (formatBomb) Is(error) bool          { return false }

var _ fmt.Formatter = formatBomb{}

// messageMetrics reads every drop's reason, as a metrics or tracing
// exporter keeping the message would.
type messageMetrics struct{}

func (messageMetrics) HandlerDone(time.Duration, error) {}
func (messageMetrics) Recovered(time.Duration)          {}
func (messageMetrics) Dropped(reason error, _ int)      { _ = reason.Error() }

// Promise (README: a handler panic is "recovered, logged with its stack,
// backed off", not "kills the process" as in containerd): an error cannot
// take the process down. Returning a typed nil pointer as an error is Go's
// best-known nil trap, and the error's methods are user code: *nilPtrErr
// panics in Error, *net.OpError in Unwrap (errors.Is calls it), a bomb in
// Error and again when the panic's value is printed. Before the fixes the
// process died: at the handler's replay (its log line called Error), at
// its first failure with logrus's JSON formatter (which calls Error), in
// handle's errors.Is for *net.OpError, in the stream reader for a
// converter's such error, in an exit watcher logging its status's, and,
// for a bomb, wherever a recover printed it; a bomb from an error's Format
// (which checked does not call) when a drop's reason was read; and a
// resync hook's panic, recovered nowhere. Now the handler's event fails
// and backs off, the converter's envelope is dropped, the stream's error
// is reported and the exit is handled with UnknownExitCode. Each scenario
// runs in a child process so that a crash fails this test, not the test
// binary.
func TestUserCodePanicsDoNotCrash(t *testing.T) {
	if scenario := os.Getenv("EVENTMONITOR_PANICKING_ERROR_CHILD"); scenario != "" {
		panickingErrorScenario(t, scenario)
		return
	}
	for _, scenario := range []string{"text", "json", "unwrap", "converter", "exit", "bomb", "bomb-stream", "bomb-exit", "format", "resync"} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestUserCodePanicsDoNotCrash$", "-test.count=1")
		cmd.Env = append(os.Environ(), "EVENTMONITOR_PANICKING_ERROR_CHILD="+scenario)
		out, err := cmd.CombinedOutput()
		if len(out) > 3000 {
			out = out[:3000]
		}
		assert.NoError(t, err, "scenario %s: the process running the monitor died:\n%s", scenario, out)
	}
}

func panickingErrorScenario(t *testing.T, scenario string) {
	logger := logrus.New()
	logger.Out = io.Discard
	if scenario != "text" {
		logger.Formatter = &logrus.JSONFormatter{}
	}
	opts := []Option{WithLogger(logrus.NewEntry(logger))}
	switch scenario {
	case "exit", "bomb-exit":
		h := newHarness(t, newRecorder(), opts...)
		build := func(code uint32, _ time.Time) any { return ev{"a", int(code)} }
		if scenario == "exit" {
			exits := make(chan fakeExit, 1)
			exits <- fakeExit{err: (*nilPtrErr)(nil)}
			<-WatchExit(context.Background(), h.m, "a", exits, build)
		} else {
			exits := make(chan bombStatus, 1)
			exits <- bombStatus{}
			<-WatchExit(context.Background(), h.m, "a", exits, build)
		}
		h.settled(t)
		require.Equal(t, uint64(1), h.m.Stats().Handled)
		return
	case "converter":
		conv := ConverterFunc(func(typeurl.Any) (string, any, error) {
			var err *net.OpError
			return "", nil, err
		})
		h := newHarness(t, newRecorder(), append(opts, WithConverter(conv))...)
		stream := newFakeStream()
		h.m.Subscribe(stream)
		h.m.Start()
		(<-stream.newSub).send(t, envelope(t, "ns", wrapperspb.String("x")))
		waitFor(t, func() bool { return len(h.drops.all()) == 1 }, "the envelope is dropped")
		require.ErrorIs(t, h.drops.all()[0].Reason, ErrInvalidEvent)
		return
	case "format":
		// A Metrics labelling drops by message reads the reason, whose
		// text includes the handler's error.
		h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
			return formatBomb{}
		}), append(opts, WithMaxAttempts(1), WithMetrics(messageMetrics{}))...)
		h.submit(t, ev{"a", 1})
		h.settled(t)
		require.Equal(t, uint64(1), h.m.Stats().Dropped)
		return
	case "resync":
		stream := newFakeStream()
		h := newHarness(t, newRecorder(), append(opts, WithConverter(testConverter),
			WithResubscribe(time.Second, time.Second),
			WithResync(func(context.Context) error { panic("relist failed") }))...)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		runErr := make(chan error, 1)
		go func() { runErr <- h.m.Run(ctx, stream) }()
		(<-stream.newSub).errs <- errors.New("daemon gone")
		waitFor(t, h.clock.HasWaiters, "Run waits to re-subscribe")
		h.clock.Step(time.Second)
		sub := <-stream.newSub
		sub.send(t, envelope(t, "ns", wrapperspb.String("c1"))) // established: the resync hook runs
		waitFor(t, func() bool { return h.m.Stats().Handled == 1 }, "handled")
		cancel()
		require.NoError(t, <-runErr)
		return
	case "bomb-stream":
		h := newHarness(t, newRecorder(), append(opts, WithConverter(testConverter))...)
		errs := make(chan error, 1)
		errs <- bomb{}
		h.m.Subscribe(SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) {
			return make(chan *Envelope), errs
		}))
		require.Error(t, <-h.m.Start(), "Start's reader reports the stream's error")
		return
	}
	var calls atomic.Int32
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		if calls.Add(1) > 1 {
			return nil
		}
		switch scenario {
		case "unwrap":
			var err *net.OpError
			return err // Error is "<nil>"; Unwrap panics
		case "bomb":
			return bomb{}
		}
		var err *nilPtrErr
		return err // Error panics
	}), opts...)
	h.submit(t, ev{"a", 1})
	h.step(t, DefaultInitialBackoff) // the replay
	require.Equal(t, int32(2), calls.Load())
	s := h.m.Stats()
	require.Equal(t, [2]uint64{1, 1}, [2]uint64{s.Failed, s.Handled}, "%+v", s)
}

// checked, which guards every error from user code before it is logged
// (the stream's, the resync hook's, an exit status's too), passes errors
// through as they are and replaces one whose Error panics.
func TestCheckedReplacesOnlyAnErrorWhoseErrorPanics(t *testing.T) {
	require.NoError(t, checked(nil))
	plain := errors.New("plain")
	require.Same(t, plain, checked(plain))
	var opErr *net.OpError // Error is "<nil>": kept
	require.Equal(t, error(opErr), checked(opErr))
	safe := checked((*nilPtrErr)(nil))
	require.NotPanics(t, func() { _ = safe.Error() })
	require.Contains(t, safe.Error(), "*eventmonitor.nilPtrErr whose Error panics")
}
