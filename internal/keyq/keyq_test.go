package keyq

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var t0 = time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)

const sec = time.Second

var testDelays = Delays{Initial: sec, Max: 8 * sec}

func norm[T any](s []T) []T { return append([]T{}, s...) }

// checkSet checks the Set's containers and gauges against a recount.
func checkSet(t testing.TB, s *Set[int]) {
	t.Helper()
	inQ := map[*Key[int]]bool{}
	var prev *Key[int]
	for k := s.ready.head; k != nil; k = k.next {
		require.False(t, inQ[k], "run queue cycle at %s", k.name)
		require.True(t, k.prev == prev, "prev link of %s", k.name)
		require.True(t, s.keys[k.name] == k, "%s in run queue, not in map", k.name)
		inQ[k], prev = true, k
	}
	require.True(t, s.ready.tail == prev, "run queue tail")
	require.Equal(t, s.ready.head != nil, s.HasReady())
	for i, k := range s.waiting {
		require.Equal(t, i, k.index, "heap index of %s", k.name)
		require.True(t, s.keys[k.name] == k, "%s in heap, not in map", k.name)
		require.True(t, i == 0 || !s.waiting.Less(i, (i-1)/2), "heap order at %d", i)
	}
	if len(s.waiting) > 0 {
		require.True(t, s.Earliest() == s.waiting[0])
	} else {
		require.Nil(t, s.Earliest())
	}
	ready, waiting, events, bk, be := 0, 0, 0, 0, 0
	for name, k := range s.keys {
		require.Equal(t, name, k.name)
		require.Equal(t, k.phase == Ready, inQ[k], "%s phase %d vs run queue", name, k.phase)
		if k.phase != Ready {
			require.True(t, k.prev == nil && k.next == nil, "%s keeps run queue links", name)
		}
		switch k.phase {
		case Idle:
			t.Fatalf("Idle key %s in the map", name)
		case Ready:
			ready++
			require.Positive(t, k.Len(), name)
			if k.backoff != nil {
				require.True(t, k.backoff.replayLeft > 0 && k.backoff.replayLeft <= k.Len(), "%s replay", name)
			}
		case Waiting:
			waiting++
			require.Positive(t, k.Len(), name)
			require.NotNil(t, k.backoff, name)
			require.True(t, k.index >= 0 && k.index < len(s.waiting) && s.waiting[k.index] == k, "%s not in heap", name)
		}
		if k.phase != Waiting {
			require.Equal(t, -1, k.index, "%s index", name)
		}
		events += k.Len()
		if k.backoff != nil {
			bk, be = bk+1, be+k.Len()
		}
	}
	n := 0
	s.Keys(func(k *Key[int]) { n++ })
	require.Equal(t, len(s.keys), n, "Keys")
	require.Equal(t, ready, len(inQ))
	require.Equal(t, waiting, len(s.waiting))
	require.Equal(t, events-be, s.Queued(), "Queued")
	gk, ge := s.InBackoff()
	require.Equal(t, [2]int{bk, be}, [2]int{gk, ge}, "InBackoff")
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
	s.Push("b", 3)
	require.Equal(t, Ready, a.Phase())
	require.Equal(t, 3, s.Queued())
	checkSet(t, s)
	take(t, s, "a", 1, false)
	b := take(t, s, "b", 3, false)
	k, _, _ := s.Take()
	require.Nil(t, k, "Running keys are not ready")
	s.Done(a, true)
	require.Equal(t, Ready, a.Phase())
	s.Done(b, false)
	require.Nil(t, s.Get("b"), "an empty key is Idle")
	take(t, s, "a", 2, false)
	s.Done(a, true)
	require.Nil(t, s.Get("a"))
	checkSet(t, s)
}

func TestFailedReplay(t *testing.T) {
	s := New[int](testDelays)
	k := s.Push("a", 1)
	s.Push("a", 2)
	take(t, s, "a", 1, false)
	s.Failed(k, 1, t0)
	require.Equal(t, Waiting, k.Phase())
	require.Equal(t, []int{1, 2}, k.Items())
	require.Equal(t, t0.Add(sec), k.Due())
	require.Equal(t, sec, k.Delay())
	require.True(t, s.Earliest() == k)
	require.Equal(t, 0, s.Queued())
	checkSet(t, s)
	s.Replay(k)
	require.Equal(t, Ready, k.Phase())
	s.Push("a", 3) // not part of the replay
	take(t, s, "a", 1, true)
	s.Done(k, true)
	require.True(t, k.InBackoff())
	take(t, s, "a", 2, false)
	s.Done(k, true)
	require.False(t, k.InBackoff())
	require.Zero(t, k.Delay())
	require.Equal(t, Ready, k.Phase())
	require.Equal(t, 1, s.Queued())
	checkSet(t, s)
	take(t, s, "a", 3, false)
	s.Failed(k, 3, t0)
	require.Equal(t, sec, k.Delay(), "an ordinary event's failure waits Initial")
}

func TestDoubling(t *testing.T) {
	s := New[int](Delays{Initial: sec, Max: 5 * sec})
	k := s.Push("a", 1)
	s.Push("a", 2)
	take(t, s, "a", 1, false)
	now := t0
	s.Failed(k, 1, now)
	for _, want := range []time.Duration{2, 4, 5, 5} {
		s.Replay(k)
		take(t, s, "a", 1, true)
		now = now.Add(time.Minute)
		s.Failed(k, 1, now)
		require.Equal(t, want*sec, k.Delay())
		require.Equal(t, now.Add(want*sec), k.Due())
	}
	s.Replay(k)
	take(t, s, "a", 1, true)
	s.Done(k, true)
	take(t, s, "a", 2, false)
	s.Failed(k, 2, now)
	require.Equal(t, sec, k.Delay(), "a replay that handled an event waits Initial")
	require.Equal(t, now.Add(sec), k.Due())
}

func TestDoublingNearMaxInt64(t *testing.T) {
	s := New[int](Delays{Initial: math.MaxInt64 / 2, Max: math.MaxInt64})
	k := s.Push("a", 1)
	take(t, s, "a", 1, false)
	s.Failed(k, 1, t0)
	require.Equal(t, time.Duration(math.MaxInt64/2), k.Delay())
	for range 3 {
		s.Replay(k)
		take(t, s, "a", 1, true)
		s.Failed(k, 1, t0)
		require.Equal(t, time.Duration(math.MaxInt64), k.Delay())
		require.True(t, k.Due().After(t0))
		require.Equal(t, t0.Add(math.MaxInt64), k.Due())
	}
}

func TestPushBackoff(t *testing.T) {
	s := New[int](testDelays)
	k := s.PushBackoff("a", 1, t0)
	require.Equal(t, Waiting, k.Phase())
	require.Equal(t, t0.Add(sec), k.Due())
	s.PushBackoff("a", 2, t0.Add(sec)) // already in backoff: keeps its due
	require.Equal(t, t0.Add(sec), k.Due())
	keys, events := s.InBackoff()
	require.Equal(t, [2]int{1, 2}, [2]int{keys, events})
	checkSet(t, s)

	for _, fail := range []bool{false, true} {
		s := New[int](testDelays)
		k := s.Push("b", 1)
		take(t, s, "b", 1, false)
		s.PushBackoff("b", 2, t0)
		require.Equal(t, Running, k.Phase())
		require.Equal(t, t0.Add(sec), k.Due())
		checkSet(t, s)
		if fail {
			s.Failed(k, 1, t0.Add(time.Hour))
		} else {
			s.Done(k, true)
		}
		require.Equal(t, Waiting, k.Phase())
		require.Equal(t, t0.Add(sec), k.Due(), "fail=%v keeps the due", fail)
		checkSet(t, s)
	}
}

func TestForget(t *testing.T) {
	s := New[int](testDelays)
	require.Nil(t, s.Forget("none"))
	s.Push("r", 1)
	s.Push("r", 2)
	s.PushBackoff("w", 3, t0)
	s.PushBackoff("w", 4, t0)
	k := s.Push("x", 5)
	s.Push("y", 9)
	take(t, s, "r", 1, false)
	s.Push("r", 6)
	s.Push("r", 7)
	require.Equal(t, []int{5}, s.Forget("x"))
	require.Equal(t, []int{3, 4}, s.Forget("w"))
	require.Nil(t, s.Earliest())
	require.Equal(t, []int{2, 6, 7}, s.Forget("r"))
	r := s.Get("r")
	require.Equal(t, Running, r.Phase())
	checkSet(t, s)
	take(t, s, "y", 9, false)
	s.Done(r, true)
	require.Nil(t, s.Get("r"))
	require.Equal(t, Idle, k.Phase())
	checkSet(t, s)
}

func TestEarliest(t *testing.T) {
	s := New[int](testDelays)
	for i, d := range []time.Duration{5, 2, 9, 3} {
		s.PushBackoff(string(rune('a'+i)), i, t0.Add(d*sec))
	}
	for _, want := range []string{"b", "d", "a", "c"} {
		require.Equal(t, want, s.Earliest().Name())
		s.Forget(want)
		checkSet(t, s)
	}
}

func TestJitter(t *testing.T) {
	var r float64
	d := Delays{Initial: 4 * sec, Max: 8 * sec, Jitter: 0.25, Rand: func() float64 { return r }}
	for _, c := range []struct {
		r    float64
		want time.Duration
	}{{0, 3 * sec}, {0.5, 4 * sec}, {0.75, 4500 * time.Millisecond}, {math.Nextafter(1, 0), 5 * sec}} {
		r = c.r
		k := New[int](d).PushBackoff("a", 1, t0)
		got := k.Due().Sub(t0)
		require.InDelta(t, float64(c.want), float64(got), 1, "r=%v", c.r)
		require.True(t, got >= 3*sec && got <= 5*sec, "r=%v: %v", c.r, got)
	}
	// Saturation: a spread of nearly 2*(MaxInt64/2) must not wrap to the past.
	d = Delays{Initial: math.MaxInt64/2 - 1, Max: math.MaxInt64, Jitter: 1, Rand: func() float64 { return r }}
	for _, r = range []float64{0.99, 0.999999, math.Nextafter(1, 0)} {
		k := New[int](d).PushBackoff("a", 1, t0)
		require.True(t, k.Due().After(t0), "r=%v: due %v", r, k.Due())
	}
	r = 0
	require.Equal(t, t0.Add(1), New[int](d).PushBackoff("a", 1, t0).Due(), "at least 1ns")
}

// A delay above MaxInt64/2 with jitter is cut to MaxInt64/2, far below the
// delay's -Jitter bound (here: no spread at all, yet half the delay).
func TestJitterKeepsLargeDelay(t *testing.T) {
	d := Delays{Initial: math.MaxInt64, Max: math.MaxInt64, Jitter: 0.1, Rand: func() float64 { return 0.5 }}
	got := New[int](d).PushBackoff("a", 1, t0).Due().Sub(t0)
	lo := 0.9 * float64(math.MaxInt64)
	require.GreaterOrEqual(t, float64(got), lo, "due now+%v, want now+%v±10%%", got, time.Duration(math.MaxInt64))
}

// mkey is the reference model of one key.
type mkey struct {
	events                             []int
	phase                              Phase
	call                               int // the event of the call in progress
	backoff, inCall, begun, progressed bool
	replayLeft                         int
	delay                              time.Duration
	due                                time.Time
}

type model struct {
	t     testing.TB
	s     *Set[int]
	keys  map[string]*mkey // not Idle
	ready []string         // run queue order
	now   time.Time
	next  int         // next event
	ended map[int]int // events done or forgotten
}

func newModel(t testing.TB) *model {
	return &model{t: t, s: New[int](testDelays), keys: map[string]*mkey{}, now: t0, ended: map[int]int{}}
}

func (m *model) setPhase(name string, mk *mkey, p Phase) {
	if mk.phase == Ready {
		i := 0
		for m.ready[i] != name {
			i++
		}
		m.ready = append(m.ready[:i], m.ready[i+1:]...)
	}
	mk.phase = p
	switch p {
	case Ready:
		m.ready = append(m.ready, name)
	case Idle:
		delete(m.keys, name)
	}
}

func (m *model) running() []string {
	var names []string
	for _, n := range keyNames {
		if mk := m.keys[n]; mk != nil && mk.phase == Running {
			names = append(names, n)
		}
	}
	return names
}

var keyNames = []string{"a", "b", "c", "d", "e", "f", "g", "h"}

func (m *model) step(op, arg byte) {
	t := m.t
	m.now = m.now.Add(time.Duration(arg%4) * 300 * time.Millisecond)
	name := keyNames[arg%8]
	switch op % 10 {
	case 0, 1, 2: // Push, PushBackoff
		ev := m.next
		m.next++
		mk := m.keys[name]
		if mk == nil {
			mk = &mkey{}
			m.keys[name] = mk
		}
		mk.events = append(mk.events, ev)
		if mk.phase == Idle {
			m.setPhase(name, mk, Ready)
		}
		if op%10 != 2 {
			m.s.Push(name, ev)
			break
		}
		m.s.PushBackoff(name, ev, m.now)
		if !mk.backoff {
			*mk = mkey{events: mk.events, phase: mk.phase, call: mk.call, backoff: true, delay: sec, due: m.now.Add(sec)}
			if mk.phase == Ready {
				m.setPhase(name, mk, Waiting)
			}
		}
	case 3, 4: // Take
		k, it, start := m.s.Take()
		if len(m.ready) == 0 {
			require.Nil(t, k)
			return
		}
		name = m.ready[0]
		mk := m.keys[name]
		require.NotNil(t, k)
		require.Equal(t, [2]any{name, mk.events[0]}, [2]any{k.Name(), it})
		wantStart := false
		if mk.backoff && mk.replayLeft > 0 {
			wantStart, mk.begun, mk.inCall = !mk.begun, true, true
			mk.replayLeft--
		}
		require.Equal(t, wantStart, start, "replayStart")
		mk.call, mk.events = it, mk.events[1:]
		m.setPhase(name, mk, Running)
	case 5, 6: // Done, Failed
		names := m.running()
		if len(names) == 0 {
			return
		}
		name = names[int(arg/8)%len(names)]
		mk, k := m.keys[name], m.s.Get(name)
		if op%10 == 5 {
			progressed := arg&1 == 0
			m.s.Done(k, progressed)
			m.ended[mk.call]++
			if mk.backoff && mk.inCall {
				mk.inCall, mk.progressed = false, mk.progressed || progressed
				mk.backoff = mk.replayLeft > 0 // the replay is over
			}
			switch {
			case mk.backoff && mk.replayLeft == 0: // PushBackoff during the call
				m.setPhase(name, mk, Waiting)
			case len(mk.events) > 0:
				m.setPhase(name, mk, Ready)
			default:
				m.setPhase(name, mk, Idle)
			}
			return
		}
		m.s.Failed(k, mk.call, m.now)
		mk.events = append([]int{mk.call}, mk.events...)
		switch {
		case mk.backoff && !mk.inCall: // due set by PushBackoff during the call
		case mk.backoff && !mk.progressed: // the replay failed on its first event
			mk.delay = min(2*mk.delay, testDelays.Max)
			mk.due = m.now.Add(mk.delay)
		default:
			*mk = mkey{events: mk.events, phase: mk.phase, backoff: true, delay: sec, due: m.now.Add(sec)}
		}
		mk.inCall, mk.replayLeft = false, 0
		m.setPhase(name, mk, Waiting)
	case 7: // Replay the earliest
		var first *mkey
		for _, mk := range m.keys {
			if mk.phase == Waiting && (first == nil || mk.due.Before(first.due)) {
				first = mk
			}
		}
		k := m.s.Earliest()
		if first == nil {
			require.Nil(t, k)
			return
		}
		require.NotNil(t, k)
		mk := m.keys[k.Name()]
		require.Equal(t, Waiting, mk.phase)
		require.True(t, mk.due.Equal(first.due), "Earliest: %v, want due %v", mk.due, first.due)
		m.s.Replay(k)
		mk.replayLeft, mk.begun, mk.progressed = len(mk.events), false, false
		m.setPhase(k.Name(), mk, Ready)
	case 8: // Forget
		got := m.s.Forget(name)
		mk := m.keys[name]
		if mk == nil {
			require.Nil(t, got)
			return
		}
		require.Equal(t, norm(mk.events), norm(got), "Forget(%s)", name)
		for _, ev := range got {
			m.ended[ev]++
		}
		*mk = mkey{phase: mk.phase, call: mk.call}
		if mk.phase != Running {
			m.setPhase(name, mk, Idle)
		}
	}
}

func (m *model) check() {
	t := m.t
	checkSet(t, m.s)
	require.Equal(t, len(m.keys), len(m.s.keys))
	seen := map[int]int{}
	for ev, n := range m.ended {
		seen[ev] += n
	}
	for name, mk := range m.keys {
		k := m.s.Get(name)
		require.NotNil(t, k, name)
		require.Equal(t, mk.phase, k.Phase(), name)
		require.Equal(t, norm(mk.events), norm(k.Items()), name)
		require.Equal(t, mk.backoff, k.InBackoff(), name)
		if !mk.backoff {
			mk.delay, mk.due = 0, time.Time{}
		}
		require.Equal(t, mk.delay, k.Delay(), name)
		require.True(t, mk.due.Equal(k.Due()), "%s due %v, want %v", name, k.Due(), mk.due)
		for _, ev := range mk.events {
			seen[ev]++
		}
		if mk.phase == Running {
			seen[mk.call]++
		}
	}
	var order []string
	for k := m.s.ready.head; k != nil; k = k.next {
		order = append(order, k.name)
	}
	require.Equal(t, norm(m.ready), norm(order), "run queue order")
	require.Len(t, seen, m.next, "events lost")
	for ev, n := range seen {
		if n != 1 {
			t.Fatalf("event %d held %d times", ev, n)
		}
	}
}

func runModel(t testing.TB, ops []byte) *model {
	m := newModel(t)
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
		// End every call and forget the rest: every event ends exactly once.
		for _, name := range m.running() {
			m.step(5, byte(slices.Index(keyNames, name)))
		}
		for i := range keyNames {
			m.step(8, byte(i))
		}
		m.check()
		require.Empty(t, m.s.keys)
		require.Len(t, m.ended, m.next)
	}
}

func FuzzSet(f *testing.F) {
	f.Add([]byte{0, 0, 0, 0, 3, 0, 6, 0, 7, 0, 3, 0, 6, 0, 7, 0, 3, 0, 5, 0})
	f.Add([]byte{0, 1, 3, 1, 2, 1, 0, 1, 5, 1, 7, 1, 3, 1, 8, 1, 5, 1})
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) > 512 {
			ops = ops[:512]
		}
		runModel(t, ops)
	})
}
