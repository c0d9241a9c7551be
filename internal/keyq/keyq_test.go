package keyq

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var t0 = time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)

const (
	sec  = time.Second
	none = time.Duration(-1) // for is: not in backoff
)

var testDelays = Delays{Initial: sec, Max: 8 * sec}

func norm[T any](s []T) []T { return append([]T{}, s...) }

// checkSet checks the run queue, the heap and the map against each other
// and the gauges against a recount.
func checkSet(t testing.TB, s *Set[int]) {
	t.Helper()
	ok := func(c bool, format string, args ...any) {
		if !c {
			t.Helper()
			t.Fatalf(format, args...)
		}
	}
	inQ := map[*Key[int]]bool{}
	var prev, first *Key[int]
	for k := s.ready.head; k != nil; prev, k = k, k.next {
		ok(!inQ[k] && k.prev == prev && s.keys[k.name] == k, "run queue at %s: cycle, bad prev or not in map", k.name)
		inQ[k] = true
	}
	ok(s.ready.tail == prev && s.HasReady() == (prev != nil), "run queue tail or HasReady")
	for i, k := range s.waiting {
		ok(k.index == i && s.keys[k.name] == k, "heap[%d] = %s: index %d or not in map", i, k.name, k.index)
		ok(i == 0 || !s.waiting.Less(i, (i-1)/2), "heap order at %d", i)
		first = s.waiting[0]
	}
	ok(s.Earliest() == first, "Earliest is not the heap's top")
	n, events, bk, be := 0, 0, 0, 0
	s.Keys(func(k *Key[int]) {
		n, events = n+1, events+k.Len()
		name, p, b := k.name, k.phase, k.backoff
		ok(s.keys[name] == k && p != Idle, "%s: Idle or not in map", name)
		ok((p == Ready) == inQ[k], "%s: phase %d, in run queue %v", name, p, inQ[k])
		ok(p == Ready || k.prev == nil && k.next == nil, "%s keeps run queue links", name)
		ok((p == Waiting) == (k.index >= 0), "%s: phase %d, heap index %d", name, p, k.index)
		ok(p != Waiting || k.index < len(s.waiting) && s.waiting[k.index] == k && b != nil, "%s not in heap or backoff", name)
		ok(p == Running || k.Len() > 0, "%s: phase %d with no events", name, p)
		ok(p != Ready || b == nil || b.replayLeft > 0 && b.replayLeft <= k.Len(), "%s: Ready in backoff, no replay", name)
		if b != nil {
			bk, be = bk+1, be+k.Len()
		}
	})
	ok(n == len(s.keys), "Keys visited %d of %d", n, len(s.keys))
	gk, ge := s.InBackoff()
	ok(s.Queued() == events-be && gk == bk && ge == be, "gauges: Queued %d InBackoff %d,%d; recount %d %d,%d",
		s.Queued(), gk, ge, events-be, bk, be)
}

// is checks k's phase, events and due (an offset from t0, or none).
func is(t *testing.T, s *Set[int], k *Key[int], p Phase, due time.Duration, items ...int) {
	t.Helper()
	require.Equal(t, p, k.Phase(), "phase")
	require.Equal(t, norm(items), norm(k.Items()), "items")
	require.Equal(t, due != none, k.InBackoff(), "in backoff")
	if due == none {
		require.True(t, k.Due().IsZero() && k.Delay() == 0, "due %v delay %v outside backoff", k.Due(), k.Delay())
	} else {
		require.Equal(t, t0.Add(due), k.Due(), "due")
	}
	require.Equal(t, p == Idle, s.Get(k.Name()) == nil, "in Get")
	checkSet(t, s)
}

func take(t *testing.T, s *Set[int], name string, want int, wantStart bool) *Key[int] {
	t.Helper()
	k, it, start := s.Take()
	require.NotNil(t, k, "nothing ready")
	require.Equal(t, [3]any{name, want, wantStart}, [3]any{k.Name(), it, start})
	require.Equal(t, Running, k.Phase())
	checkSet(t, s)
	return k
}

func TestPushTakeDone(t *testing.T) {
	s := New[int](testDelays)
	a := s.Push("a", 1)
	s.Push("a", 2)
	b := s.Push("b", 3)
	is(t, s, a, Ready, none, 1, 2)
	require.Equal(t, 3, s.Queued())
	take(t, s, "a", 1, false)
	take(t, s, "b", 3, false)
	k, _, _ := s.Take()
	require.Nil(t, k, "Running keys are not ready")
	s.Done(a)
	is(t, s, a, Ready, none, 2)
	s.Done(b)
	is(t, s, b, Idle, none)
	take(t, s, "a", 2, false)
	s.Done(a)
	is(t, s, a, Idle, none)
}

// TakeAlone takes a key only when the event just pushed is all it holds and
// it is not in backoff: nothing of the key may be passed.
func TestTakeAlone(t *testing.T) {
	s := New[int](testDelays)
	a := s.Push("a", 1)
	it, ok := s.TakeAlone(a)
	require.True(t, ok)
	require.Equal(t, 1, it)
	is(t, s, a, Running, none)
	s.Push("a", 2)
	_, ok = s.TakeAlone(a)
	require.False(t, ok, "a call of the key is in progress")
	s.Done(a)
	s.Push("a", 3)
	_, ok = s.TakeAlone(a)
	require.False(t, ok, "an earlier event waits")
	b := s.PushBackoff("b", 4, t0)
	_, ok = s.TakeAlone(b)
	require.False(t, ok, "in backoff")
}

func TestFailedReplay(t *testing.T) {
	s := New[int](testDelays)
	k := s.Push("a", 1)
	s.Push("a", 2)
	take(t, s, "a", 1, false)
	s.Failed(k, 1, t0)
	is(t, s, k, Waiting, sec, 1, 2)
	require.Equal(t, [2]any{sec, 0}, [2]any{k.Delay(), s.Queued()})
	s.Replay(k)
	s.Push("a", 3) // not part of the replay
	is(t, s, k, Ready, sec, 1, 2, 3)
	take(t, s, "a", 1, true)
	s.Done(k)
	is(t, s, k, Ready, sec, 2, 3)
	take(t, s, "a", 2, false)
	s.Done(k)
	is(t, s, k, Ready, none, 3) // the replay is over: 3 is an ordinary event
	require.Equal(t, 1, s.Queued())
	take(t, s, "a", 3, false)
	s.Failed(k, 3, t0.Add(time.Hour))
	is(t, s, k, Waiting, time.Hour+sec, 3)
}

func TestDoubling(t *testing.T) {
	for _, c := range []struct {
		d     Delays
		wants []time.Duration // after each replay that fails on its first event
	}{
		{Delays{Initial: sec, Max: 5 * sec}, []time.Duration{2 * sec, 4 * sec, 5 * sec, 5 * sec}},
		{Delays{Initial: math.MaxInt64 / 2, Max: math.MaxInt64}, []time.Duration{math.MaxInt64 - 1, math.MaxInt64, math.MaxInt64}}, // 2d exactly, then the cap; no overflow
	} {
		s := New[int](c.d)
		k := s.Push("a", 1)
		s.Push("a", 2)
		take(t, s, "a", 1, false)
		s.Failed(k, 1, t0)
		is(t, s, k, Waiting, c.d.Initial, 1, 2)
		var now time.Duration
		for _, want := range c.wants {
			s.Replay(k)
			take(t, s, "a", 1, true)
			now += time.Minute
			s.Failed(k, 1, t0.Add(now))
			require.Equal(t, want, k.Delay())
			require.True(t, k.Due().After(t0.Add(now)), "due %v", k.Due())
			require.Equal(t, t0.Add(now).Add(want), k.Due())
			require.Equal(t, [2]any{Waiting, []int{1, 2}}, [2]any{k.Phase(), k.Items()})
			checkSet(t, s)
		}
		s.Replay(k)
		take(t, s, "a", 1, true)
		s.Done(k)
		take(t, s, "a", 2, false)
		s.Failed(k, 2, t0.Add(now))
		require.Equal(t, c.d.Initial, k.Delay(), "a replay past its first event (handled or given up on) waits Initial")
		is(t, s, k, Waiting, now+c.d.Initial, 2)
	}
}

func TestPushBackoff(t *testing.T) {
	s := New[int](testDelays)
	k := s.PushBackoff("a", 1, t0)
	is(t, s, k, Waiting, sec, 1)
	s.PushBackoff("a", 2, t0.Add(sec)) // in backoff already: keeps its due
	is(t, s, k, Waiting, sec, 1, 2)
	keys, events := s.InBackoff()
	require.Equal(t, [2]int{1, 2}, [2]int{keys, events})
	s.Push("b", 3)
	is(t, s, s.PushBackoff("b", 4, t0), Waiting, sec, 3, 4)
	for _, fail := range []bool{false, true} {
		s := New[int](testDelays)
		k := s.Push("r", 1)
		take(t, s, "r", 1, false)
		s.PushBackoff("r", 2, t0)
		is(t, s, k, Running, sec, 2)
		if fail {
			s.Failed(k, 1, t0.Add(time.Hour))
			is(t, s, k, Waiting, time.Hour+sec, 1, 2) // a failure waits from itself, not from the push
		} else {
			s.Done(k)
			is(t, s, k, Waiting, sec, 2)
		}
	}
}

// An event PushBackoff adds while the key replays is not part of the
// replay: once the replay is done, the key waits again, the initial delay
// from that push.
func TestPushBackoffDuringReplay(t *testing.T) {
	s := New[int](testDelays)
	k := s.PushBackoff("a", 1, t0)
	s.Replay(k)
	take(t, s, "a", 1, true)
	s.PushBackoff("a", 2, t0.Add(3*sec))
	is(t, s, k, Running, sec, 2)
	s.Done(k)
	is(t, s, k, Waiting, 4*sec, 2)
	s.Replay(k)
	take(t, s, "a", 2, true)
	s.Done(k)
	is(t, s, k, Idle, none)
}

func TestForgetEarliest(t *testing.T) {
	s := New[int](testDelays)
	require.Nil(t, s.Forget("none"))
	r := s.Push("r", 1)
	s.Push("r", 2)
	x := s.Push("x", 5)
	s.Push("y", 9)
	var w []*Key[int]
	for i, d := range []time.Duration{5, 2, 9, 3} {
		w = append(w, s.PushBackoff(fmt.Sprint("w", i), 10*i, t0.Add(d*sec)))
		s.PushBackoff(fmt.Sprint("w", i), 10*i+1, t0)
	}
	take(t, s, "r", 1, false)
	s.Push("r", 6)
	require.Equal(t, []int{5}, s.Forget("x"))
	is(t, s, x, Idle, none)
	for _, i := range []int{1, 3, 0, 2} { // in order of due
		require.True(t, s.Earliest() == w[i])
		require.Equal(t, []int{10 * i, 10*i + 1}, s.Forget(w[i].Name()))
		is(t, s, w[i], Idle, none)
	}
	require.Equal(t, []int{2, 6}, s.Forget("r"))
	is(t, s, r, Running, none)
	take(t, s, "y", 9, false)
	s.Done(r)
	is(t, s, r, Idle, none)
}

func TestJitter(t *testing.T) {
	var r float64
	rnd := func() float64 { return r }
	for _, c := range [][2]float64{{0, 3}, {0.5, 4}, {0.75, 4.5}, {math.Nextafter(1, 0), 5}} {
		r = c[0]
		got := New[int](Delays{Initial: 4 * sec, Jitter: 0.25, Rand: rnd}).PushBackoff("a", 1, t0).Due().Sub(t0)
		require.InDelta(t, c[1]*float64(sec), float64(got), 1, "r=%v", r)
		require.True(t, got >= 3*sec && got <= 5*sec, "r=%v: %v", r, got)
	}
	// Saturation: no spread wraps to the past, none of a huge delay is lost.
	for _, d := range []time.Duration{math.MaxInt64/2 - 1, math.MaxInt64 / 2, math.MaxInt64} {
		for _, r = range []float64{0.5, 0.99, 0.999999, math.Nextafter(1, 0)} {
			due := New[int](Delays{Initial: d, Jitter: 1, Rand: rnd}).PushBackoff("a", 1, t0).Due()
			require.True(t, due.After(t0), "d=%v r=%v: due %v", d, r, due)
			require.GreaterOrEqual(t, float64(due.Sub(t0)), min(2*r*float64(d), math.MaxInt64)*(1-1e-9), "d=%v r=%v", d, r)
		}
	}
	r = 0
	require.Equal(t, t0.Add(1), New[int](Delays{Initial: sec, Jitter: 1, Rand: rnd}).PushBackoff("a", 1, t0).Due())
}

// Forget during a replay's call takes every queued event, a PushBackoff's
// during the replay too, but the key stays in backoff until the call ends,
// the replay's last: its failure doubles the delay as any replay's first.
func TestForgetDuringReplay(t *testing.T) {
	for _, fail := range []bool{false, true} {
		s := New[int](testDelays)
		k := s.Push("a", 1)
		s.Push("a", 2)
		take(t, s, "a", 1, false)
		s.Failed(k, 1, t0)
		s.Replay(k)
		take(t, s, "a", 1, true)
		s.PushBackoff("a", 3, t0.Add(sec))
		require.Equal(t, []int{2, 3}, s.Forget("a"))
		is(t, s, k, Running, sec) // replaying, with no event left
		if fail {
			s.Failed(k, 1, t0.Add(2*sec))
			require.Equal(t, 2*sec, k.Delay())
			is(t, s, k, Waiting, 4*sec, 1)
		} else {
			s.Done(k)
			is(t, s, k, Idle, none)
		}
	}
}

// mkey is the reference model of one key; call is its call's event.
type mkey struct {
	events                             []int
	phase                              Phase
	call, replayLeft                   int
	backoff, inCall, begun, progressed bool
	delay                              time.Duration
	due, afterReplay                   time.Time
}

type model struct {
	t         testing.TB
	s         *Set[int]
	keys      map[string]*mkey // not Idle
	ready     []string         // the run queue
	now       time.Time
	next      int          // events pushed: 0..next-1
	ended     map[int]bool // events done or forgotten
	doublings int
}

var keyNames = []string{"a", "b", "c", "d", "e", "f", "g", "h"}

func (m *model) set(name string, mk *mkey, p Phase) {
	if i := slices.Index(m.ready, name); mk.phase == Ready {
		m.ready = slices.Delete(m.ready, i, i+1)
	}
	if mk.phase = p; p == Ready {
		m.ready = append(m.ready, name)
	} else if p == Idle {
		delete(m.keys, name)
	}
}

func (m *model) end(ev int) {
	require.False(m.t, m.ended[ev], "event %d ended twice", ev)
	m.ended[ev] = true
}

// step does op (mod 9) on the key named by arg, or on a Running key.
func (m *model) step(op, arg byte) {
	t, name, op := m.t, keyNames[arg%8], op%9
	m.now = m.now.Add(time.Duration(arg>>6) * 300 * time.Millisecond)
	if op == 5 || op == 6 {
		running := slices.DeleteFunc(slices.Clone(keyNames), func(n string) bool { return m.keys[n] == nil || m.keys[n].phase != Running })
		if len(running) == 0 {
			return
		}
		name = running[int(arg/8)%len(running)]
	}
	mk := m.keys[name]
	switch op {
	case 0, 1, 2: // Push, PushBackoff
		if mk == nil {
			mk = &mkey{}
			m.keys[name] = mk
		}
		ev := m.next
		if m.next, mk.events = ev+1, append(mk.events, ev); mk.phase == Idle {
			m.set(name, mk, Ready)
		}
		if op < 2 {
			m.s.Push(name, ev)
			return
		}
		m.s.PushBackoff(name, ev, m.now)
		if mk.backoff && (mk.replayLeft > 0 || mk.inCall) && mk.afterReplay.IsZero() {
			mk.afterReplay = m.now.Add(sec) // waits again after the replay
		}
		if !mk.backoff {
			*mk = mkey{events: mk.events, phase: mk.phase, call: mk.call, backoff: true, delay: sec, due: m.now.Add(sec)}
			if mk.phase == Ready {
				m.set(name, mk, Waiting)
			}
		}
	case 3, 4: // Take
		k, it, start := m.s.Take()
		if require.Equal(t, len(m.ready) == 0, k == nil, "Take"); k == nil {
			return
		}
		name = m.ready[0]
		mk = m.keys[name]
		replayStart := false
		if mk.backoff && mk.replayLeft > 0 {
			replayStart, mk.begun, mk.inCall, mk.replayLeft = !mk.begun, true, true, mk.replayLeft-1
		}
		require.Equal(t, [3]any{name, mk.events[0], replayStart}, [3]any{k.Name(), it, start}, "Take")
		mk.call, mk.events = it, mk.events[1:]
		m.set(name, mk, Running)
	case 5: // Done
		m.s.Done(m.s.Get(name))
		if m.end(mk.call); mk.backoff && mk.inCall {
			mk.inCall, mk.progressed = false, true
			if mk.backoff = mk.replayLeft > 0; !mk.backoff && !mk.afterReplay.IsZero() { // a PushBackoff during the replay
				*mk = mkey{events: mk.events, phase: mk.phase, call: mk.call, backoff: true, delay: sec, due: mk.afterReplay}
			}
		}
		switch {
		case mk.backoff && mk.replayLeft == 0: // PushBackoff during the call
			m.set(name, mk, Waiting)
		case len(mk.events) > 0:
			m.set(name, mk, Ready)
		default:
			m.set(name, mk, Idle)
		}
	case 6: // Failed
		m.s.Failed(m.s.Get(name), mk.call, m.now)
		mk.events = append([]int{mk.call}, mk.events...)
		if mk.backoff && mk.inCall && !mk.progressed { // the replay failed on its first event
			mk.delay, m.doublings = min(2*mk.delay, testDelays.Max), m.doublings+1
			mk.due, mk.afterReplay = m.now.Add(mk.delay), time.Time{}
		} else {
			*mk = mkey{events: mk.events, phase: mk.phase, backoff: true, delay: sec, due: m.now.Add(sec)}
		}
		mk.inCall, mk.replayLeft = false, 0
		m.set(name, mk, Waiting)
	case 7: // Replay the earliest
		var first *mkey
		for _, c := range m.keys {
			if c.phase == Waiting && (first == nil || c.due.Before(first.due)) {
				first = c
			}
		}
		k := m.s.Earliest()
		if require.Equal(t, first == nil, k == nil, "Earliest"); k == nil {
			return
		}
		mk = m.keys[k.Name()]
		require.True(t, mk.phase == Waiting && mk.due.Equal(first.due), "Earliest %s due %v, want %v", k.Name(), mk.due, first.due)
		m.s.Replay(k)
		mk.replayLeft, mk.begun, mk.progressed = len(mk.events), false, false
		m.set(k.Name(), mk, Ready)
	case 8: // Forget
		got := m.s.Forget(name)
		if mk == nil {
			require.Nil(t, got)
			return
		}
		require.Equal(t, norm(mk.events), norm(got), "Forget(%s)", name)
		for _, ev := range got {
			m.end(ev)
		}
		if mk.backoff && mk.inCall { // the replay ends with its call
			mk.events, mk.replayLeft, mk.afterReplay = nil, 0, time.Time{}
			return
		}
		if *mk = (mkey{phase: mk.phase, call: mk.call}); mk.phase != Running {
			m.set(name, mk, Idle)
		}
	}
}

// check compares the Set with the model and checks that every event pushed
// is held (queued or in a call) or ended, once.
func (m *model) check() {
	checkSet(m.t, m.s)
	want, got, held := map[string]string{}, map[string]string{}, map[int]bool{}
	for name, mk := range m.keys {
		if !mk.backoff {
			mk.delay, mk.due = 0, time.Time{}
		}
		want[name] = fmt.Sprint(mk.phase, norm(mk.events), mk.backoff, mk.delay, mk.due)
		evs := slices.Clone(mk.events)
		if mk.phase == Running {
			evs = append(evs, mk.call)
		}
		for _, ev := range evs {
			if held[ev] || m.ended[ev] {
				m.t.Fatalf("event %d held twice, or held and ended", ev)
			}
			held[ev] = true
		}
	}
	m.s.Keys(func(k *Key[int]) {
		got[k.name] = fmt.Sprint(k.phase, norm(k.Items()), k.InBackoff(), k.Delay(), k.Due())
	})
	var order []string
	for k := m.s.ready.head; k != nil; k = k.next {
		order = append(order, k.name)
	}
	require.Equal(m.t, want, got, "phase, events, in backoff, delay, due")
	require.Equal(m.t, norm(m.ready), norm(order), "run queue order")
	require.Equal(m.t, m.next, len(held)+len(m.ended), "events lost")
}

func runModel(t testing.TB, ops []byte) *model {
	m := &model{t: t, s: New[int](testDelays), keys: map[string]*mkey{}, now: t0, ended: map[int]bool{}}
	for i := 0; i+1 < len(ops); i += 2 {
		m.step(ops[i], ops[i+1])
		m.check()
	}
	return m
}

func TestModel(t *testing.T) {
	for seed := range uint64(4) {
		r := rand.New(rand.NewPCG(seed, 1))
		ops := make([]byte, 6000)
		for i := range ops {
			ops[i] = byte(r.IntN(256))
		}
		m := runModel(t, ops)
		require.Positive(t, m.doublings)
		for i := 0; len(m.keys) > 0; i++ { // drain: every event ends
			require.Less(t, i, len(ops))
			m.step(7, 0) // Replay
			m.step(3, 0) // Take
			m.step(5, 0) // Done
			m.check()
		}
		require.Len(t, m.ended, m.next)
	}
}

func FuzzSet(f *testing.F) {
	f.Add([]byte{0, 0, 0, 0, 3, 0, 6, 0, 7, 0, 3, 0, 6, 0, 7, 0, 3, 0, 5, 0})
	f.Add([]byte{0, 1, 3, 1, 2, 1, 0, 1, 5, 1, 7, 1, 3, 1, 8, 1, 5, 1, 3, 1, 6, 1})
	f.Fuzz(func(t *testing.T, ops []byte) { runModel(t, ops[:min(len(ops), 1024)]) })
}

// A key that is never idle reuses its array while its worker keeps up (a
// pop that empties the queue rewinds it), and drops a burst's array once
// the burst is handled (pops move the slice's start, so append's next
// growth leaves the array behind).
func TestABusyKeysArrayIsReusedButABurstsIsNotKept(t *testing.T) {
	s := New[int](testDelays)
	s.Push("a", 0)
	k, _, _ := s.Take()
	if allocs := testing.AllocsPerRun(100, func() {
		s.Push("a", 1) // arrives while its predecessor's call runs
		s.Done(k)
		s.Take()
	}); allocs != 0 {
		t.Errorf("%v allocations an event, with one at a time queued; want 0", allocs)
	}

	const burst = 100000
	for i := range burst {
		s.Push("a", i)
	}
	for k.Len() > 2 {
		s.Done(k)
		s.Take()
	}
	for i := range burst {
		s.Done(k)
		s.Take()
		s.Push("a", i)
	}
	checkSet(t, s)
	if c := cap(k.items); c > 64 {
		t.Errorf("after a burst of %d, %d events queued hold an array of %d", burst, k.Len(), c)
	}
}
