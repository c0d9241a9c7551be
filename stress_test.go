package eventmonitor_test

// TestStress drives a Monitor through its public API only, from many
// goroutines at once, with a handler that randomly fails, panics, runs slow
// or (with a deadline) overruns it, and checks afterwards that:
//
//   - no key was ever handled on two goroutines at once;
//   - each key's handler calls came in sequence order, and no event was
//     called while an earlier event of its key had not ended for good;
//   - every accepted event ended exactly once: handled successfully, handed
//     to the drop handler, or returned by Forget; every refused one never
//     reached the handler or the drop handler;
//   - every Stats snapshot, taken concurrently all along, satisfies the
//     accounting identity, and the final one agrees with the test's counts
//     and with what Metrics heard;
//   - no goroutine outlives the monitor.
//
// Variants: "deadlines" (WithHandleTimeout(50ms), WithMaxAttempts(5): drops
// for max attempts, and rare handlers that overrun the deadline ignoring
// ctx) and "no-deadlines" (WithHandleTimeout(0), WithMaxQueuedPerKey(6):
// Submit refusals, and Backoff and exits dropped with ErrQueueFull). Both end
// with Stop or Shutdown, as the seed says.
//
// One exception to "exactly once": with a deadline, Stop abandons a call
// still running past it and drops its event with ErrStopped; if that call
// later returns nil, the success is not a second ending (and Stats does not
// count it). The handler marks calls that may have overrun and returned
// after Stop or Shutdown began ("late"); only those are excused, and only
// when the event's one drop is ErrStopped. No call starts an overrun once
// Stop or Shutdown began.
//
// A failure prints the seed; rerun with -stress.seed=N or STRESS_SEED=N.
// The real clock makes timing differ from run to run, but the drivers'
// choices and each handler call's outcome (per key, seq and attempt) follow
// the seed.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"go.uber.org/goleak"

	"github.com/eventmonitor/eventmonitor"
)

var stressSeed = flag.Int64("stress.seed", 0, "seed of TestStress (default: $STRESS_SEED, else the time)")

func stressSeedValue(t *testing.T) int64 {
	if *stressSeed != 0 {
		return *stressSeed
	}
	if s := os.Getenv("STRESS_SEED"); s != "" {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("STRESS_SEED=%q: %v", s, err)
		}
		return v
	}
	return time.Now().UnixNano()
}

// stressConfig is one variant of the stress test.
type stressConfig struct {
	timeout     time.Duration // WithHandleTimeout
	maxAttempts int           // WithMaxAttempts
	maxQueued   int           // WithMaxQueuedPerKey
	keys        int
	steps       int           // per key
	driveFor    time.Duration // the drivers stop after this, steps done or not
}

func TestStress(t *testing.T) {
	seed := stressSeedValue(t)
	keys, steps, driveFor := 64, 400, 2500*time.Millisecond
	if testing.Short() {
		keys, steps, driveFor = 32, 100, 600*time.Millisecond
	}
	t.Run("deadlines", func(t *testing.T) {
		runStress(t, seed, stressConfig{timeout: 50 * time.Millisecond, maxAttempts: 5,
			keys: keys, steps: steps, driveFor: driveFor})
	})
	t.Run("no-deadlines", func(t *testing.T) {
		runStress(t, seed, stressConfig{timeout: 0, maxQueued: 6,
			keys: keys, steps: steps, driveFor: driveFor})
	})
}

// eventKind is how an event was handed to the monitor.
type eventKind uint8

const (
	kindSubmit eventKind = iota
	kindBackoff
	kindExit
)

func (k eventKind) String() string {
	return [...]string{"submit", "backoff", "exit"}[k]
}

// stressEvent is the handler's event: its key (by index too) and its
// sequence number within the key, in the order its driver handed it over.
type stressEvent struct {
	Key  string
	K    int
	Seq  int
	Kind eventKind
}

func (e stressEvent) String() string { return fmt.Sprintf("%s/%d(%v)", e.Key, e.Seq, e.Kind) }

type evID struct{ k, seq int }

func (e stressEvent) id() evID { return evID{e.K, e.Seq} }

// stressExit is the exit the exit watchers read.
type stressExit struct {
	code uint32
	at   time.Time
	err  error
}

func (s stressExit) Result() (uint32, time.Time, error) { return s.code, s.at, s.err }

// stressHandler fails, panics, runs slow or overruns, as the seed says for
// each (key, seq, attempt).
type stressHandler struct {
	seed      int64
	cfg       stressConfig
	l         *ledger
	v         *violations
	stopBegan *atomic.Bool
	calls     sync.WaitGroup // handler calls running, abandoned ones too
	overruns  atomic.Int64
	panics    atomic.Int64
	derived   atomic.Int64
}

func (h *stressHandler) HandleEvent(ctx context.Context, e any) (err error) {
	h.calls.Add(1)
	defer h.calls.Done()
	se, attempt := h.l.callStart(e)
	if n := h.l.inFlight[se.K].Add(1); n > 1 {
		h.v.add("key %s: %d handler calls at once (seq %d among them)", se.Key, n, se.Seq)
	}
	start := time.Now()
	defer func() {
		h.l.inFlight[se.K].Add(-1)
		r := recover()
		if r != nil {
			err = fmt.Errorf("panicked: %v", r)
		}
		// The monitor's deadline started a little before this call's
		// start: half the timeout is a safe bound for "may have overrun".
		// Stop may abandon such a call even though it returns before Stop
		// begins: until the worker notes the return, it still runs.
		late := h.cfg.timeout > 0 && time.Since(start) > h.cfg.timeout/2
		h.l.callEnd(se, err, late)
		if r != nil {
			panic(r)
		}
	}()

	if _, ok := ctx.Deadline(); ok != (h.cfg.timeout > 0) {
		h.v.add("%v: ctx has a deadline: %v, with handle timeout %v", se, ok, h.cfg.timeout)
	}
	rng := rand.New(rand.NewPCG(uint64(h.seed), uint64(se.K)<<40^uint64(se.Seq)<<16^uint64(attempt)))
	switch p := rng.IntN(1000); {
	case p < 3 && h.cfg.timeout > 0 && !h.stopBegan.Load():
		// Overrun the deadline, ignoring ctx: the key must stay held.
		h.overruns.Add(1)
		time.Sleep(h.cfg.timeout + time.Duration(5+rng.IntN(30))*time.Millisecond)
	case p < 50:
		// Slow, but minding ctx.
		select {
		case <-time.After(time.Duration(1+rng.IntN(5)) * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
	case p < 120:
		// A derived context, as a handler calling a runtime would make.
		h.derived.Add(1)
		dctx, cancel := context.WithTimeout(ctx, time.Duration(rng.IntN(3000))*time.Microsecond)
		<-dctx.Done()
		cancel()
	}
	switch p := rng.IntN(100); {
	case p < 20:
		return fmt.Errorf("%v attempt %d: failing", se, attempt)
	case p < 28:
		h.panics.Add(1)
		panic(fmt.Sprintf("%v attempt %d: panicking", se, attempt))
	}
	return nil
}

// checkStats checks the accounting identity of one Stats snapshot, and that
// counters never go back.
func checkStats(v *violations, cfg stressConfig, s, prev eventmonitor.Stats, when string) {
	ended := s.Filtered + s.Ignored + s.Handled + s.Dropped + s.Forgotten
	inside := s.Queued + s.EventsInBackoff + s.InFlight
	if s.Queued < 0 || s.EventsInBackoff < 0 || s.InFlight < 0 || s.KeysInBackoff < 0 || s.Overrunning < 0 {
		v.add("%s: a negative gauge: %+v", when, s)
	}
	if inside < 0 || s.Received != ended+uint64(inside) {
		v.add("%s: Received %d != Filtered+Ignored+Handled+Dropped+Forgotten %d + Queued+EventsInBackoff+InFlight %d: %+v",
			when, s.Received, ended, inside, s)
	}
	if s.Filtered != 0 || s.Ignored != 0 || s.Resubscribed != 0 {
		v.add("%s: stream counters without a stream: %+v", when, s)
	}
	if s.Overrunning > s.InFlight || cfg.timeout == 0 && s.Overrunning != 0 {
		v.add("%s: Overrunning %d, InFlight %d, timeout %v", when, s.Overrunning, s.InFlight, cfg.timeout)
	}
	if s.Received < prev.Received || s.Handled < prev.Handled || s.Failed < prev.Failed ||
		s.Retried < prev.Retried || s.Dropped < prev.Dropped || s.Forgotten < prev.Forgotten {
		v.add("%s: a counter went back: %+v after %+v", when, s, prev)
	}
}

// sample calls Stats, Pending, InBackoff and NextRetry until done closes.
func sample(m *eventmonitor.Monitor, l *ledger, v *violations, cfg stressConfig, seed int64, done <-chan struct{}) (samples int) {
	rng := rand.New(rand.NewPCG(uint64(seed), 1<<62))
	var prev eventmonitor.Stats
	for i := 0; ; i++ {
		select {
		case <-done:
			return i
		default:
		}
		// The ledger's counts before the snapshot are at most the monitor's
		// (it counts before calling the drop handler and before Forget
		// returns), and its successes after are at least Handled (the
		// handler records them before returning).
		_, dropped, forgotten := l.liveCounts()
		s := m.Stats()
		successes, _, _ := l.liveCounts()
		checkStats(v, cfg, s, prev, "Stats()")
		if s.Handled > successes || s.Dropped < dropped || s.Forgotten < forgotten {
			v.add("Stats(): Handled %d, Dropped %d, Forgotten %d; the handler saw %d successes, %d drops, %d forgotten before it",
				s.Handled, s.Dropped, s.Forgotten, successes, dropped, forgotten)
		}
		prev = s
		if i%4 == 0 {
			k := rng.IntN(cfg.keys)
			key := fmt.Sprintf("k%02d", k)
			endedBefore := l.endedSet(k)
			m.InBackoff(key)
			m.Pending()
			for _, p := range m.Pending() {
				if cfg.maxAttempts > 0 && p.Attempts >= cfg.maxAttempts {
					v.add("Pending: key %s at attempt %d, max %d", p.Key, p.Attempts, cfg.maxAttempts)
				}
				prev := -1
				for _, e := range p.Events {
					se, ok := e.(stressEvent)
					if !ok || se.Key != p.Key || se.Seq <= prev {
						v.add("Pending: key %s holds %v after seq %d", p.Key, e, prev)
						continue
					}
					prev = se.Seq
					if se.K == k && endedBefore[se.Seq] {
						v.add("Pending: key %s holds %v, which had ended before Pending was called", p.Key, se)
					}
				}
			}
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// A driver pauses after pauseChance percent of its steps, for pauseMean on
// average: enough to let the workers keep up with 64 keys under -race on 2
// CPUs most of the time, while the bursts in between build queues.
const (
	pauseChance = 50
	pauseMean   = 16 * time.Millisecond
)

// driver hands key k's events to the monitor, one step at a time.
func drive(ctx context.Context, m *eventmonitor.Monitor, l *ledger, v *violations, cfg stressConfig,
	seed int64, k int, until time.Time) (exits int) {
	rng := rand.New(rand.NewPCG(uint64(seed), uint64(k)))
	key := fmt.Sprintf("k%02d", k)
	seq := 0
	next := func(kind eventKind) stressEvent {
		seq++
		e := stressEvent{Key: key, K: k, Seq: seq, Kind: kind}
		l.offer(e)
		return e
	}
	for step := 0; step < cfg.steps && time.Now().Before(until); step++ {
		switch p := rng.IntN(100); {
		case p < 55:
			e := next(kindSubmit)
			l.settle(e, m.Submit(key, e))
		case p < 70:
			e := next(kindBackoff)
			m.Backoff(key, e) // accepted, or dropped
			l.settle(e, nil)
		case p < 82:
			exits++
			e := next(kindExit)
			if !exitStep(ctx, m, v, rng, e) {
				return exits
			}
			l.settle(e, nil)
		case p < 84:
			l.forgot(k, key, m.Forget(key))
		default:
			runtime.Gosched()
		}
		// Bursts, and pauses that let the workers catch up.
		if rng.IntN(100) < pauseChance {
			time.Sleep(time.Duration(rng.IntN(int(2 * pauseMean))))
		}
	}
	return exits
}

// exitStep hands e over as an exit through WatchExit and waits until the
// exit watcher handled or queued it. It reports false if it never did.
func exitStep(ctx context.Context, m *eventmonitor.Monitor, v *violations, rng *rand.Rand, e stressEvent) bool {
	ch := make(chan stressExit, 1)
	at := time.Unix(int64(e.Seq), 0)
	wantCode, wantAt := uint32(e.Seq%200), at
	mode := rng.IntN(10)
	if mode >= 7 {
		wantCode, wantAt = eventmonitor.UnknownExitCode, time.Time{}
	}
	deliver := func() {
		switch {
		case mode < 7:
			ch <- stressExit{code: wantCode, at: at}
		case mode < 9:
			ch <- stressExit{err: errors.New("no status")}
		default:
			close(ch)
		}
	}
	var built atomic.Bool
	build := func(code uint32, exitedAt time.Time) any {
		if built.Swap(true) {
			v.add("%v: exit event built twice", e)
		}
		if code != wantCode || !wantAt.IsZero() && !exitedAt.Equal(wantAt) {
			v.add("%v: exit built with code %d at %v, want %d at %v", e, code, exitedAt, wantCode, wantAt)
		}
		return e
	}
	sendFirst := rng.IntN(2) == 0
	if sendFirst {
		deliver()
	}
	done := eventmonitor.WatchExit(ctx, m, e.Key, (<-chan stressExit)(ch), build)
	if !sendFirst {
		deliver()
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		v.add("%v: WatchExit's channel not closed 10 s after the exit", e)
		return false
	}
	if !built.Load() {
		v.add("%v: WatchExit's channel closed but the exit was never built", e)
		return false
	}
	return true
}

// stressMetrics counts what Metrics hears, for the final Stats to match.
type stressMetrics struct{ calls, dropped atomic.Uint64 }

func (s *stressMetrics) HandlerDone(time.Duration, error) { s.calls.Add(1) }
func (s *stressMetrics) Recovered(time.Duration)          {}
func (s *stressMetrics) Dropped(_ error, events int)      { s.dropped.Add(uint64(events)) }

func runStress(t *testing.T, seed int64, cfg stressConfig) {
	t.Logf("seed %d (rerun with -stress.seed=%d or STRESS_SEED=%d); %+v", seed, seed, seed, cfg)
	rng := rand.New(rand.NewPCG(uint64(seed), 1<<63))
	v := &violations{}
	var stopBegan atomic.Bool
	l := newLedger(cfg, v, &stopBegan)
	h := &stressHandler{seed: seed, cfg: cfg, l: l, v: v, stopBegan: &stopBegan}
	logger := logrus.New()
	logger.SetOutput(io.Discard) // panics log their stacks

	metrics := &stressMetrics{}
	m, err := eventmonitor.New(h,
		eventmonitor.WithBackoff(time.Millisecond, 8*time.Millisecond),
		eventmonitor.WithJitter(0.5),
		eventmonitor.WithWorkers(4),
		eventmonitor.WithHandleTimeout(cfg.timeout),
		eventmonitor.WithMaxAttempts(cfg.maxAttempts),
		eventmonitor.WithMaxQueuedPerKey(cfg.maxQueued),
		eventmonitor.WithDropHandler(l.dropped),
		eventmonitor.WithLogger(logrus.NewEntry(logger)),
		eventmonitor.WithMetrics(metrics),
	)
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()

	samplerDone := make(chan struct{})
	var samples int
	var samplerWG sync.WaitGroup
	samplerWG.Add(1)
	go func() {
		defer samplerWG.Done()
		samples = sample(m, l, v, cfg, seed, samplerDone)
	}()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	until := began.Add(cfg.driveFor)
	var drivers sync.WaitGroup
	var exits atomic.Int64
	for k := range cfg.keys {
		drivers.Add(1)
		go func() {
			defer drivers.Done()
			exits.Add(int64(drive(ctx, m, l, v, cfg, seed, k, until)))
		}()
	}
	drivers.Wait()
	drove := time.Since(began)

	// Stop or Shutdown, with the sampler still sampling. From here on no
	// handler call starts an overrun; one already overrunning may be
	// abandoned (see ledger.check).
	stopBegan.Store(true)
	useShutdown := rng.IntN(2) == 0
	stopStart := time.Now()
	var shutdownErr error
	if useShutdown {
		sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
		shutdownErr = m.Shutdown(sctx)
		scancel()
	} else {
		m.Stop()
	}
	stopTook := time.Since(stopStart)
	close(samplerDone)
	samplerWG.Wait()
	switch {
	case shutdownErr == nil:
	case cfg.timeout > 0 && errors.Is(shutdownErr, eventmonitor.ErrStopped):
		t.Logf("Shutdown: %v", shutdownErr)
	default:
		v.add("Shutdown: %v", shutdownErr)
	}

	// After Stop: Submit refuses, Backoff drops.
	late := stressEvent{Key: "k00", K: 0, Seq: 1 << 30, Kind: kindSubmit}
	l.offer(late)
	l.settleAfterStop(late, m.Submit(late.Key, late))
	lateB := stressEvent{Key: "k00", K: 0, Seq: 1<<30 + 1, Kind: kindBackoff}
	l.offer(lateB)
	m.Backoff(lateB.Key, lateB)
	l.settle(lateB, nil)
	ch := make(chan stressExit, 1)
	ch <- stressExit{code: 1}
	select {
	case <-eventmonitor.WatchExit(context.Background(), m, "k00", (<-chan stressExit)(ch), func(uint32, time.Time) any {
		v.add("WatchExit after Stop built its exit")
		return nil
	}):
	case <-time.After(5 * time.Second):
		v.add("WatchExit after Stop: channel not closed")
	}

	h.calls.Wait() // abandoned calls return too
	tot := l.check()
	s := m.Stats()
	checkStats(v, cfg, s, eventmonitor.Stats{}, "final Stats()")
	if s.Queued != 0 || s.EventsInBackoff != 0 || s.KeysInBackoff != 0 || s.InFlight != 0 || s.Overrunning != 0 {
		v.add("final Stats(): gauges not 0: %+v", s)
	}
	if s.Received != tot.accepted {
		v.add("final Stats(): Received %d, but %d events were accepted", s.Received, tot.accepted)
	}
	if s.Handled != tot.counted {
		v.add("final Stats(): Handled %d, but handlers succeeded %d times (%d counting abandoned calls)",
			s.Handled, tot.counted, tot.successes)
	}
	if s.Dropped != tot.dropped {
		v.add("final Stats(): Dropped %d, but the drop handler got %d events", s.Dropped, tot.dropped)
	}
	if s.Forgotten != tot.forgotten {
		v.add("final Stats(): Forgotten %d, but Forget returned %d events", s.Forgotten, tot.forgotten)
	}
	if got := metrics.dropped.Load(); got != s.Dropped {
		v.add("final Stats(): Dropped %d, but Metrics.Dropped counted %d events", s.Dropped, got)
	}
	if got := metrics.calls.Load(); got != s.Handled+s.Failed {
		v.add("final Stats(): Handled+Failed %d, but Metrics.HandlerDone heard %d calls", s.Handled+s.Failed, got)
	}
	if s.Failed > tot.failures || s.Failed < tot.failures-tot.lateFailures {
		v.add("final Stats(): Failed %d, but handlers failed %d times (%d of them late)", s.Failed, tot.failures, tot.lateFailures)
	}

	l.mu.Lock()
	t.Logf("drove %v (%d samples), %s took %v; accepted %d (%d exits), Submit refused %v; "+
		"handled %d, failed %d (%d panics), dropped %v, forgotten %d; %d overruns (%d abandoned successes), %d derived contexts, %d suspects excused",
		drove.Round(time.Millisecond), samples, map[bool]string{true: "Shutdown", false: "Stop"}[useShutdown],
		stopTook.Round(time.Millisecond), tot.accepted, exits.Load(), l.submitErrs, s.Handled, s.Failed,
		h.panics.Load(), l.dropsBy, s.Forgotten, h.overruns.Load(), tot.abandonedOK, h.derived.Load(), len(l.suspects))
	l.mu.Unlock()

	v.report(t, seed)
	goleak.VerifyNone(t)
}
