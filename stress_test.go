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

// violations collects what went wrong, from any goroutine, for the end.
type violations struct {
	mu   sync.Mutex
	n    int
	msgs []string
}

func (v *violations) add(format string, args ...any) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.n++
	if len(v.msgs) < 40 {
		v.msgs = append(v.msgs, fmt.Sprintf(format, args...))
	}
}

func (v *violations) report(t *testing.T, seed int64) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, msg := range v.msgs {
		t.Error(msg)
	}
	if v.n > 0 {
		t.Errorf("%d violations (%d shown); seed %d: rerun with STRESS_SEED=%d", v.n, len(v.msgs), seed, seed)
	}
}

// acceptance is where an event stands with the monitor.
type acceptance uint8

const (
	offering acceptance = iota // Submit, Backoff or WatchExit under way
	accepted                   // the monitor took it (Stats().Received counts it)
	refused                    // Submit returned an error: the caller owns it
)

// evRecord is everything that happened to one event.
type evRecord struct {
	ev         stressEvent
	status     acceptance
	calls      int     // handler calls started
	failures   int     // calls that returned an error or panicked
	lateFails  int     // of those, calls that may have overrun: Stop may have abandoned them
	successes  int     // calls that returned nil
	lateOK     bool    // a success of a call that may have overrun: Stop may have abandoned it
	drops      []error // reasons of the drops that carried it
	forgotten  int     // times Forget returned it
	lastReturn bool    // the last call has returned
}

// attemptBudget is how many failed calls e may have before it is dropped:
// Backoff counts one attempt.
func attemptBudget(e stressEvent, maxAttempts int) int {
	if e.Kind == kindBackoff {
		return maxAttempts - 1
	}
	return maxAttempts
}

func (r *evRecord) ended() bool { return r.successes > 0 || len(r.drops) > 0 || r.forgotten > 0 }

// keyRecord is one key's events, in sequence order, and its handler calls.
type keyRecord struct {
	seqs       []int // every event offered, in sequence order
	low        int   // seqs[:low] have all ended or were refused
	lastCalled int   // the highest seq called so far
}

// suspect is a call of seq while an earlier event of its key had not ended.
// It is fine only if the earlier event was given up on (ErrMaxAttempts) and
// the drop handler, which runs without the monitor's lock, had not been
// called yet.
type suspect struct {
	k, seq, earlier int
}

// ledger records every event from its offering to its end.
type ledger struct {
	cfg        stressConfig
	v          *violations
	stopBegan  *atomic.Bool
	mu         sync.Mutex
	events     map[evID]*evRecord
	keys       []keyRecord
	suspects   []suspect
	unknown    int
	live       struct{ successes, dropped, forgotten uint64 } // running totals, for the sampler
	submitErrs map[string]int                                 // Submit errors by sentinel
	dropsBy    map[string]int                                 // dropped events by sentinel
	inFlight   []atomic.Int32                                 // per key: handler calls running now
}

func newLedger(cfg stressConfig, v *violations, stopBegan *atomic.Bool) *ledger {
	return &ledger{
		cfg:        cfg,
		v:          v,
		stopBegan:  stopBegan,
		events:     map[evID]*evRecord{},
		keys:       make([]keyRecord, cfg.keys),
		submitErrs: map[string]int{},
		dropsBy:    map[string]int{},
		inFlight:   make([]atomic.Int32, cfg.keys),
	}
}

func sentinel(err error) string {
	for _, s := range []struct {
		err  error
		name string
	}{
		{eventmonitor.ErrMaxAttempts, "max_attempts"},
		{eventmonitor.ErrQueueFull, "queue_full"},
		{eventmonitor.ErrStopped, "stopped"},
		{eventmonitor.ErrInvalidEvent, "invalid"},
	} {
		if errors.Is(err, s.err) {
			return s.name
		}
	}
	return fmt.Sprintf("other(%v)", err)
}

// offer records an event about to be handed to the monitor. Its handler may
// run before the call that hands it over returns.
func (l *ledger) offer(e stressEvent) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events[e.id()] = &evRecord{ev: e}
	l.keys[e.K].seqs = append(l.keys[e.K].seqs, e.Seq)
}

// settle records whether the monitor took the event.
func (l *ledger) settle(e stressEvent, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.events[e.id()]
	if err == nil {
		r.status = accepted
		return
	}
	r.status = refused
	l.submitErrs[sentinel(err)]++
	if !errors.Is(err, eventmonitor.ErrQueueFull) || l.cfg.maxQueued == 0 {
		l.v.add("%v: Submit refused it with %v", e, err)
	}
	if r.calls > 0 || len(r.drops) > 0 {
		l.v.add("%v: refused by Submit (%v), yet handled %d times and dropped %d times", e, err, r.calls, len(r.drops))
	}
}

// settleAfterStop records Submit's answer after Stop: ErrStopped.
func (l *ledger) settleAfterStop(e stressEvent, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.events[e.id()]
	if errors.Is(err, eventmonitor.ErrStopped) {
		r.status = refused
		return
	}
	r.status = accepted
	l.v.add("%v: Submit after Stop returned %v, want ErrStopped", e, err)
}

// lookup returns an event's record; mu is held.
func (l *ledger) lookup(e any, what string) (stressEvent, *evRecord) {
	se, ok := e.(stressEvent)
	if !ok {
		l.v.add("%s: an event of type %T: %v", what, e, e)
		return se, nil
	}
	r := l.events[se.id()]
	if r == nil || r.ev != se {
		l.unknown++
		l.v.add("%s: %v was never offered", what, se)
		return se, nil
	}
	return se, r
}

// callStart records a handler call's start and returns its attempt number
// (0 for the first call of the event).
func (l *ledger) callStart(e any) (stressEvent, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	se, r := l.lookup(e, "handler")
	if r == nil {
		return se, 0
	}
	switch {
	case r.status == refused:
		l.v.add("%v: handled although Submit refused it", se)
	case r.successes > 0:
		l.v.add("%v: called again after it was handled successfully", se)
	case r.forgotten > 0:
		l.v.add("%v: called after Forget returned it", se)
	case len(r.drops) > 0:
		l.v.add("%v: called after it was dropped (%v)", se, r.drops[0])
	case r.calls > 0 && !r.lastReturn:
		l.v.add("%v: called while its previous call is still running", se)
	}
	kr := &l.keys[se.K]
	if se.Seq < kr.lastCalled {
		l.v.add("key %s: seq %d called after seq %d: out of order", se.Key, se.Seq, kr.lastCalled)
	}
	kr.lastCalled = max(kr.lastCalled, se.Seq)
	for kr.low < len(kr.seqs) {
		er := l.events[evID{se.K, kr.seqs[kr.low]}]
		if er.status != refused && !er.ended() {
			break
		}
		kr.low++
	}
	for _, seq := range kr.seqs[kr.low:] {
		if seq >= se.Seq {
			break
		}
		if er := l.events[evID{se.K, seq}]; er.status != refused && !er.ended() {
			l.suspects = append(l.suspects, suspect{se.K, se.Seq, seq})
		}
	}
	attempt := r.calls
	r.calls++
	r.lastReturn = false
	return se, attempt
}

// callEnd records how a handler call returned. late: it overran its
// deadline and returned after Stop or Shutdown began, so the monitor may
// have abandoned it (dropped its event with ErrStopped and will not count
// its outcome).
func (l *ledger) callEnd(se stressEvent, err error, late bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.events[se.id()]
	if r == nil || r.ev != se {
		return // reported at its start
	}
	r.lastReturn = true
	switch {
	case err != nil:
		r.failures++
		if late {
			r.lateFails++
		}
	default:
		r.successes++
		l.live.successes++
		r.lateOK = r.lateOK || late
		if r.successes > 1 {
			l.v.add("%v: handled successfully %d times", se, r.successes)
		}
	}
}

// dropped records a Drop.
func (l *ledger) dropped(d eventmonitor.Drop) {
	stopping := l.stopBegan.Load()
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(d.Events) == 0 {
		l.v.add("a drop of key %q without events: %v", d.Key, d.Reason)
	}
	if d.Topic != "" || d.Namespace != "" {
		l.v.add("a drop of key %q with topic %q, namespace %q for a submitted event", d.Key, d.Topic, d.Namespace)
	}
	reason := sentinel(d.Reason)
	l.dropsBy[reason] += len(d.Events)
	prev := -1
	for _, e := range d.Events {
		se, r := l.lookup(e, "drop handler")
		if r == nil {
			continue
		}
		if se.Key != d.Key {
			l.v.add("%v: dropped under key %q", se, d.Key)
		}
		if se.Seq <= prev {
			l.v.add("%v: dropped after seq %d in the same Drop: out of order", se, prev)
		}
		prev = se.Seq
		r.drops = append(r.drops, d.Reason)
		l.live.dropped++
		switch reason {
		case "max_attempts":
			if l.cfg.maxAttempts == 0 {
				l.v.add("%v: dropped for max attempts without WithMaxAttempts", se)
			} else if r.failures != attemptBudget(se, l.cfg.maxAttempts) {
				l.v.add("%v: dropped for max attempts after %d failed calls (max %d)", se, r.failures, l.cfg.maxAttempts)
			}
		case "queue_full":
			if l.cfg.maxQueued == 0 || se.Kind == kindSubmit {
				l.v.add("%v: dropped with %v (queue bound %d)", se, d.Reason, l.cfg.maxQueued)
			}
		case "stopped":
			if !stopping {
				l.v.add("%v: dropped with %v before Stop or Shutdown began", se, d.Reason)
			}
		default:
			l.v.add("%v: dropped with unexpected reason %v", se, d.Reason)
		}
	}
}

// forgot records what Forget returned.
func (l *ledger) forgot(k int, key string, events []any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	prev := -1
	for _, e := range events {
		se, r := l.lookup(e, "Forget")
		if r == nil {
			continue
		}
		if se.K != k {
			l.v.add("Forget(%q) returned %v of another key", key, se)
		}
		if se.Seq <= prev {
			l.v.add("Forget(%q) returned %v after seq %d: out of order", key, se, prev)
		}
		prev = se.Seq
		if r.calls > 0 && !r.lastReturn {
			l.v.add("Forget(%q) returned %v while a call of it runs", key, se)
		}
		r.forgotten++
		l.live.forgotten++
	}
}

// totals are the ledger's counts, to compare with Stats.
type totals struct {
	accepted, successes, counted, dropped, forgotten uint64
	failures, lateFailures, abandonedOK              uint64
}

// check verifies that every event ended exactly once and returns the counts.
func (l *ledger) check() totals {
	l.mu.Lock()
	defer l.mu.Unlock()
	var tot totals
	for _, r := range l.events {
		e := r.ev
		tot.failures += uint64(r.failures)
		tot.lateFailures += uint64(r.lateFails)
		tot.successes += uint64(r.successes)
		tot.dropped += uint64(len(r.drops))
		tot.forgotten += uint64(r.forgotten)
		if r.status == refused {
			continue
		}
		if r.status != accepted {
			l.v.add("%v: offered but neither accepted nor refused", e)
			continue
		}
		tot.accepted++
		if r.calls > 0 && !r.lastReturn {
			l.v.add("%v: a handler call never returned", e)
		}
		if l.cfg.maxAttempts > 0 && r.failures > attemptBudget(e, l.cfg.maxAttempts) {
			l.v.add("%v: %d failed calls, beyond max attempts %d", e, r.failures, l.cfg.maxAttempts)
		}
		endings := r.successes + len(r.drops) + r.forgotten
		// A call abandoned by Stop at its deadline: the monitor dropped its
		// event with ErrStopped, and the handler returned nil (after, or
		// just before, as the worker had not yet noted it). That success is
		// not an ending (nor counted in Stats().Handled).
		abandonedOK := r.lateOK && r.successes == 1 && len(r.drops) == 1 &&
			errors.Is(r.drops[0], eventmonitor.ErrStopped)
		if abandonedOK {
			tot.abandonedOK++
			endings--
		} else {
			tot.counted += uint64(r.successes)
		}
		switch {
		case endings == 0:
			l.v.add("%v: accepted but never ended (%d calls, %d failed): lost", e, r.calls, r.failures)
		case endings > 1:
			l.v.add("%v: ended %d times: %d successes, drops %v, forgotten %d times",
				e, endings, r.successes, r.drops, r.forgotten)
		}
	}
	for _, s := range l.suspects {
		r := l.events[evID{s.k, s.earlier}]
		if len(r.drops) == 1 && errors.Is(r.drops[0], eventmonitor.ErrMaxAttempts) {
			continue
		}
		l.v.add("key k%02d: seq %d called while seq %d had not ended (it later ended: %d successes, drops %v, forgotten %d)",
			s.k, s.seq, s.earlier, r.successes, r.drops, r.forgotten)
	}
	return tot
}

// liveCounts is what the ledger has seen end so far, for the sampler.
func (l *ledger) liveCounts() (successes, dropped, forgotten uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.live.successes, l.live.dropped, l.live.forgotten
}

// endedSet returns key k's events that have ended, for the sampler's
// Pending check.
func (l *ledger) endedSet(k int) map[int]bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[int]bool{}
	for _, seq := range l.keys[k].seqs {
		if r := l.events[evID{k, seq}]; r.status == refused || r.ended() && !r.lateOK {
			out[seq] = true
		}
	}
	return out
}

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
