package eventmonitor_test

// The stress test's ledger: what happened to every event, checked against
// the promises TestStress lists.

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/eventmonitor/eventmonitor"
)

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
