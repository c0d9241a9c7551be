package eventmonitor

// A randomized run of the public operations against a model of what each
// key holds.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// modelHandler handles events for TestRandomOperationsAgainstAModel and
// holds what the test believes each key still holds: events accepted, not
// yet handled, not forgotten, in order.
type modelHandler struct {
	mu       sync.Mutex
	out      map[string][]int // outstanding seqs per key
	fails    map[ev]int       // failures left per event
	running  map[string]int
	bad      []string
	handled  map[ev]int
	gates    map[ev]chan struct{}
	nextSeq  int
	failSeen int
	clock    interface{ Now() time.Time }
}

func (md *modelHandler) dropped(d Drop) {
	md.mu.Lock()
	defer md.mu.Unlock()
	for _, e := range d.Events {
		x := e.(ev)
		if o := md.out[x.Key]; len(o) > 0 && o[0] == x.Seq {
			md.out[x.Key] = o[1:]
		} else {
			md.bad = append(md.bad, fmt.Sprintf("dropped %v (%v); outstanding %v", x, d.Reason, o))
		}
	}
}

func (md *modelHandler) note(format string, args ...any) {
	md.mu.Lock()
	defer md.mu.Unlock()
	md.bad = append(md.bad, fmt.Sprintf(format, args...))
}

func (md *modelHandler) HandleEvent(ctx context.Context, e any) error {
	x := e.(ev)
	md.mu.Lock()
	md.running[x.Key]++
	if md.running[x.Key] > 1 {
		md.bad = append(md.bad, fmt.Sprintf("%v runs beside another call of its key", x))
	}
	if o := md.out[x.Key]; len(o) == 0 || o[0] != x.Seq {
		md.bad = append(md.bad, fmt.Sprintf("%v called; outstanding %v", x, o))
	}
	gate := md.gates[x]
	delete(md.gates, x)
	md.mu.Unlock()
	if gate != nil {
		<-gate
	}
	if dl, ok := ctx.Deadline(); ok {
		if ctx.Err() != nil && md.clock.Now().Before(dl) {
			md.note("%v: ctx ended before its deadline %v (now %v)", x, dl, md.clock.Now())
		}
		if !md.clock.Now().Before(dl) {
			select {
			case <-ctx.Done():
			case <-time.After(5 * time.Second):
				md.note("%v: ctx not done at its deadline %v (now %v)", x, dl, md.clock.Now())
			}
		}
	}
	md.mu.Lock()
	var err error
	if md.fails[x] > 0 {
		md.fails[x]--
		md.failSeen++
		err = errors.New("injected")
	} else {
		md.handled[x]++
		if o := md.out[x.Key]; len(o) > 0 && o[0] == x.Seq {
			md.out[x.Key] = o[1:]
		}
	}
	md.running[x.Key]--
	md.mu.Unlock()
	return err
}

// TestRandomOperationsAgainstAModel drives Submit, Backoff, Forget, inline
// exits and clock steps at random, with calls held open so that they land
// beside a running or overrunning call of their key. It checks order, one
// call per key, deadlines, retries due without WaitIdle, and at every
// quiet point WaitIdle, NextRetry, Pending, InBackoff, Stats and the fake
// clock's waiters against a model.
func TestRandomOperationsAgainstAModel(t *testing.T) {
	for seed := uint64(0); seed < 72; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { runAgainstModel(t, seed) })
	}
}

func runAgainstModel(t *testing.T, seed uint64) {
	md := &modelHandler{out: map[string][]int{}, fails: map[ev]int{}, running: map[string]int{}, handled: map[ev]int{}, gates: map[ev]chan struct{}{}}
	var open []chan struct{}
	release := func() {
		for _, g := range open {
			close(g)
		}
		open = nil
	}
	workers := 1 + int(seed%3)
	opts := []Option{WithWorkers(workers), WithBackoff(time.Second, 8*time.Second),
		WithHandleTimeout([]time.Duration{time.Hour, 2 * time.Second, 0}[seed/3%3]), WithLogger(quietLogger()),
		WithDropHandler(md.dropped)}
	if seed/9%2 == 1 {
		opts = append(opts, WithMetrics(noopMetrics{}), WithMaxAttempts(3))
	}
	if seed/18%2 == 1 {
		opts = append(opts, WithJitter(0.5))
	}
	h := newHarness(t, md, opts...)
	md.clock = h.clock
	rnd := rand.New(rand.NewPCG(seed, 25))
	keys := []string{"a", "b", "c", "d"}
	newEv := func(k string) ev {
		md.mu.Lock()
		defer md.mu.Unlock()
		md.nextSeq++
		e := ev{k, md.nextSeq}
		md.fails[e] = []int{0, 0, 0, 1, 1, 2, 3}[rnd.IntN(7)]
		md.out[k] = append(md.out[k], e.Seq)
		if rnd.IntN(3) == 0 {
			g := make(chan struct{})
			md.gates[e] = g
			open = append(open, g)
		}
		return e
	}
	newExit := func(k string) ev {
		e := newEv(k)
		md.mu.Lock()
		defer md.mu.Unlock()
		if g := md.gates[e]; g != nil { // an inline exit's done waits for its handler
			delete(md.gates, e)
			close(g)
			open = slices.DeleteFunc(open, func(x chan struct{}) bool { return x == g })
		}
		return e
	}
	quiet := func(i int) {
		release()
		h.settled(t)
		md.mu.Lock()
		require.Empty(t, md.bad, "op %d", i)
		out := map[string][]int{}
		for k, o := range md.out {
			if len(o) > 0 {
				out[k] = slices.Clone(o)
			}
		}
		md.mu.Unlock()
		s := h.m.Stats()
		assertBalanced(t, s)
		require.Zero(t, s.InFlight, "op %d", i)
		require.Zero(t, s.Queued, "op %d: idle, events wait outside backoff: %+v", i, s)
		pend := h.m.Pending()
		got := map[string][]int{}
		var first time.Time
		evCount := 0
		for _, p := range pend {
			var seqs []int
			for _, e := range p.Events {
				seqs = append(seqs, e.(ev).Seq)
			}
			got[p.Key] = seqs
			evCount += len(seqs)
			if first.IsZero() || p.Due.Before(first) {
				first = p.Due
			}
		}
		require.Equal(t, out, got, "op %d: Pending vs model", i)
		require.Equal(t, [2]int{len(pend), evCount}, [2]int{s.KeysInBackoff, s.EventsInBackoff}, "op %d", i)
		for _, k := range keys {
			_, in := got[k]
			require.Equal(t, in, h.m.InBackoff(k), "op %d: InBackoff(%s)", i, k)
		}
		due, ok := h.m.NextRetry()
		require.Equal(t, len(pend) > 0, ok, "op %d: NextRetry", i)
		if ok {
			require.Equal(t, first, due, "op %d: NextRetry is the earliest Pending due", i)
			require.True(t, due.After(h.clock.Now()), "op %d: idle with a retry due %v at %v", i, due, h.clock.Now())
		}
		require.Equal(t, ok, h.clock.HasWaiters(), "op %d: fake clock waiters with retry pending=%v", i, ok)
	}
	for i := 0; i < 400; i++ {
		k := keys[rnd.IntN(len(keys))]
		switch op := rnd.IntN(12); op {
		case 10, 11:
			if len(open) > 0 {
				j := rnd.IntN(len(open))
				close(open[j])
				open = slices.Delete(open, j, j+1)
			}
		case 0, 1, 2:
			e := newEv(k)
			require.NoError(t, h.m.Submit(k, e))
		case 3, 4:
			h.m.Backoff(k, newEv(k))
		case 5:
			got := h.m.Forget(k)
			md.mu.Lock()
			for _, e := range got {
				x := e.(ev)
				j := slices.Index(md.out[k], x.Seq)
				require.GreaterOrEqual(t, j, 0, "Forget returned %v not outstanding", x)
				md.out[k] = slices.Delete(md.out[k], j, j+1)
			}
			md.mu.Unlock()
		case 6:
			e := newExit(k)
			exitCh := make(chan fakeExit, 1)
			exitCh <- fakeExit{}
			done := WatchExit(context.Background(), h.m, k, exitCh, func(uint32, time.Time) any { return e })
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatalf("op %d: exit %v neither handled nor queued", i, e)
			}
		case 7:
			h.clock.Step(time.Duration(rnd.IntN(1500)) * time.Millisecond)
		case 8:
			release()
			h.settled(t)
			if due, ok := h.m.NextRetry(); ok {
				before := h.m.Stats().Retried
				h.clock.SetTime(due)
				waitFor(t, func() bool { return h.m.Stats().Retried > before }, "op %d: no replay at its due %v without WaitIdle", i, due)
			}
		case 9:
			quiet(i)
		}
	}
	for n := 0; ; n++ {
		require.Less(t, n, 1000)
		quiet(-1)
		due, ok := h.m.NextRetry()
		if !ok {
			break
		}
		h.clock.SetTime(due)
	}
	md.mu.Lock()
	defer md.mu.Unlock()
	for e, n := range md.handled {
		require.Equal(t, 1, n, "%v handled %d times", e, n)
	}
	require.Positive(t, md.failSeen)
}
