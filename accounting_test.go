package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// envInt reads an integer knob of the soak test from the environment.
func envInt(t *testing.T, name string, def uint64) uint64 {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.ParseUint(v, 10, 64)
	require.NoError(t, err, "%s", name)
	return n
}

// TestAccountingUnderChaos proves that nothing vanishes: with random
// failures and panics, several goroutines submitting, and a stream that
// breaks again and again, every accepted event ends up handled successfully
// exactly once or in a Drop with a reason, and each key's successful
// handling follows its acceptance order.
//
// EVENTMONITOR_SEED picks the seed; EVENTMONITOR_SOAK_EVENTS scales the run.
// It runs with handle timeouts and without (WithHandleTimeout of 0).
func TestAccountingUnderChaos(t *testing.T) {
	// The fake clock races ahead (5 ms a step, as fast as it can): a
	// deadline far out keeps calls that are merely slow under the race
	// detector from counting as stuck.
	t.Run("deadlines", func(t *testing.T) { testAccountingUnderChaos(t, WithHandleTimeout(1000*time.Hour)) })
	t.Run("no-deadline", func(t *testing.T) { testAccountingUnderChaos(t, WithHandleTimeout(0)) })
}

func testAccountingUnderChaos(t *testing.T, opts ...Option) {
	seed := envInt(t, "EVENTMONITOR_SEED", 1)
	perSubmitter := int(envInt(t, "EVENTMONITOR_SOAK_EVENTS", 4000)) / 4
	const submitters, keysEach, streamKeys = 3, 10, 10
	t.Logf("seed %d, %d events per source", seed, perSubmitter)

	var rngMu sync.Mutex
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	roll := func() float64 { rngMu.Lock(); defer rngMu.Unlock(); return rng.Float64() }

	var mu sync.Mutex
	succeeded := map[string]int{} // event -> successful handler calls
	lastSeq := map[string]int{}   // key -> last seq handled successfully
	var panics, failures, orderViolations atomic.Int64
	handler := HandlerFunc(func(ctx context.Context, e any) error {
		var key string
		var seq int
		switch e := e.(type) {
		case ev:
			key, seq = e.Key, e.Seq
		case *wrapperspb.StringValue:
			_, err := fmt.Sscanf(e.GetValue(), "%s %d", &key, &seq)
			if err != nil {
				return err
			}
		}
		switch r := roll(); {
		case r < 0.05:
			panics.Add(1)
			panic("chaos")
		case r < 0.30:
			failures.Add(1)
			return errors.New("chaos")
		}
		mu.Lock()
		defer mu.Unlock()
		succeeded[fmt.Sprint(key, "/", seq)]++
		if seq <= lastSeq[key] {
			orderViolations.Add(1)
		}
		lastSeq[key] = seq
		return nil
	})
	conv := NewConverter(KeyOf(func(v *wrapperspb.StringValue) string {
		var key string
		fmt.Sscanf(v.GetValue(), "%s", &key)
		return key
	}))
	h := newHarness(t, handler, append([]Option{WithWorkers(4), WithConverter(conv), WithMaxAttempts(6),
		WithBackoff(10*time.Millisecond, 80*time.Millisecond), WithJitter(0.2),
		WithResubscribe(10*time.Millisecond, 40*time.Millisecond)}, opts...)...)

	var accepted sync.Map // event -> true
	stream := newFakeStream()
	runCtx, stopRun := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- h.m.Run(runCtx, stream) }()

	// The clock moves on its own, fast, as long as the test runs.
	var unaccounted atomic.Value
	stepping := make(chan struct{})
	stepperDone := make(chan struct{})
	var stopStepping sync.Once
	t.Cleanup(func() { // before the harness's leak check, should the test fail early
		stopStepping.Do(func() { close(stepping) })
		<-stepperDone
	})
	go func() {
		defer close(stepperDone)
		for {
			select {
			case <-stepping:
				return
			default:
				h.clock.Step(5 * time.Millisecond)
				// Every snapshot accounts for every event, mid-flight too.
				s := h.m.Stats()
				if in := s.Handled + s.Dropped + s.Forgotten + s.Filtered + s.Ignored +
					uint64(s.Queued+s.EventsInBackoff+s.InFlight); in != s.Received {
					unaccounted.Store(fmt.Sprintf("%d received, %d accounted for: %+v", s.Received, in, s))
				}
				runtime.Gosched()
			}
		}
	}()

	var wg sync.WaitGroup
	var breaks atomic.Int64
	wg.Add(1)
	go func() { // the stream's producer: breaks the stream every 200 events
		defer wg.Done()
		sub := <-stream.newSub
		for i := range perSubmitter {
			key := fmt.Sprintf("s%d", i%streamKeys)
			env := &Envelope{Namespace: "ns", Topic: "/chaos", Event: payload(t, wrapperspb.String(fmt.Sprintf("%s %d", key, i+1)))}
			for delivered := false; !delivered; {
				select {
				case sub.ch <- env:
					delivered = true
					accepted.Store(fmt.Sprint(key, "/", i+1), true)
				case <-sub.ctx.Done():
					sub = <-stream.newSub
				}
			}
			if i%200 == 199 {
				breaks.Add(1)
				sub.errs <- errors.New("stream broke")
				sub = <-stream.newSub
			}
		}
	}()
	for g := range submitters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perSubmitter {
				key := fmt.Sprintf("g%d-%d", g, i%keysEach)
				if h.m.Submit(key, ev{key, i + 1}) == nil {
					accepted.Store(fmt.Sprint(key, "/", i+1), true)
				}
			}
		}()
	}
	wg.Wait()
	stopRun()
	require.NoError(t, <-runDone)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, h.m.Shutdown(ctx))
	stopStepping.Do(func() { close(stepping) })
	<-stepperDone

	dropped := map[string]error{}
	for _, d := range h.drops.all() {
		require.NotNil(t, d.Reason)
		require.True(t, errors.Is(d.Reason, ErrMaxAttempts) || errors.Is(d.Reason, ErrStopped), "unexpected reason %v", d.Reason)
		for _, e := range d.Events {
			var name string
			switch e := e.(type) {
			case ev:
				name = e.String()
			case *wrapperspb.StringValue:
				var key string
				var seq int
				fmt.Sscanf(e.GetValue(), "%s %d", &key, &seq)
				name = fmt.Sprint(key, "/", seq)
			}
			_, twice := dropped[name]
			require.False(t, twice, "%s dropped twice", name)
			dropped[name] = d.Reason
		}
	}
	n := 0
	accepted.Range(func(k, _ any) bool {
		n++
		name := k.(string)
		_, wasDropped := dropped[name]
		switch succeeded[name] {
		case 0:
			require.True(t, wasDropped, "%s was neither handled nor dropped", name)
		case 1:
			require.False(t, wasDropped, "%s was handled and dropped", name)
		default:
			t.Fatalf("%s handled %d times", name, succeeded[name])
		}
		return true
	})
	require.Zero(t, orderViolations.Load(), "successful handling out of acceptance order")
	require.Nil(t, unaccounted.Load(), "a Stats snapshot taken during the run")
	s := h.m.Stats()
	require.Equal(t, uint64(n), s.Received)
	require.Equal(t, s.Received, s.Handled+s.Dropped)
	t.Logf("%d events: %d handled, %d dropped (%d handler failures, %d panics), %d stream breaks, %d re-subscriptions",
		n, s.Handled, s.Dropped, failures.Load(), panics.Load(), breaks.Load(), s.Resubscribed)
}

// The central promises, driven on the fake clock (a cold review's test). A random
// mix of Submit, Backoff (also from inside a call of its own key, so
// during a replay), Forget (also during a call), WatchExit on idle and
// busy keys, failures up to WithMaxAttempts; after every WaitIdle:
//
//   - no key on two goroutines;
//   - per key, calls in non-decreasing sequence (a retry repeats one);
//   - the Stats identity;
//   - no fake-clock timer once nothing is in backoff;
//
// and after Stop (or Shutdown, for an even seed) every accepted event
// ended exactly once. EVENTMONITOR_SEED picks the seed; by default a new
// one each run, logged.
func TestRandomOperationsOnAFakeClock(t *testing.T) {
	seed := envInt(t, "EVENTMONITOR_SEED", uint64(time.Now().UnixNano()))
	rng := rand.New(rand.NewPCG(seed, 14))
	t.Logf("seed %d", seed)

	var (
		mu       sync.Mutex
		nextSeq  = map[string]int{}
		lastCall = map[string]int{}
		ended    = map[ev]string{}
		accepted = map[ev]bool{}
		attempts = map[ev]int{}
		badOrder []string
		twice    []string
	)
	x := &exclusive{}
	var m *Monitor
	// accept assigns the key's next seq and hands the event over, under mu so
	// that seq order is accept order.
	accept := func(key string, backoff bool) {
		mu.Lock()
		defer mu.Unlock()
		nextSeq[key]++
		e := ev{key, nextSeq[key]}
		accepted[e] = true
		if backoff {
			m.Backoff(key, e)
		} else if err := m.Submit(key, e); err != nil {
			delete(accepted, e)
		}
	}
	end := func(e ev, how string) {
		mu.Lock()
		defer mu.Unlock()
		if prev, ok := ended[e]; ok {
			twice = append(twice, fmt.Sprintf("%v: %s then %s", e, prev, how))
		}
		ended[e] = how
	}
	var hrng sync.Mutex
	h := newHarness(t, HandlerFunc(func(ctx context.Context, a any) error {
		e := a.(ev)
		leave := x.enter(e.Key)
		defer leave()
		mu.Lock()
		if e.Seq < lastCall[e.Key] {
			badOrder = append(badOrder, fmt.Sprintf("%v after %s/%d", e, e.Key, lastCall[e.Key]))
		}
		lastCall[e.Key] = e.Seq
		attempts[e]++
		mu.Unlock()
		hrng.Lock()
		r := rng.IntN(10)
		hrng.Unlock()
		switch r {
		case 0:
			accept(e.Key, true) // Backoff during the call (maybe a replay's)
		case 1:
			for _, f := range m.Forget(e.Key) {
				end(f.(ev), "forgotten")
			}
		case 2:
			accept(e.Key, false)
		}
		if r >= 7 {
			return fmt.Errorf("fail %v", e)
		}
		end(e, "handled")
		return nil
	}), WithWorkers(2), WithMaxAttempts(3), WithBackoff(time.Second, 4*time.Second), WithLogger(quietLogger()))
	m = h.m
	keys := []string{"a", "b", "c"}
	for round := 0; round < 60; round++ {
		hrng.Lock()
		n := rng.IntN(4)
		ops := make([]int, n)
		ks := make([]string, n)
		for i := range ops {
			ops[i], ks[i] = rng.IntN(6), keys[rng.IntN(len(keys))]
		}
		hrng.Unlock()
		for i, op := range ops {
			switch op {
			case 0, 1:
				accept(ks[i], false)
			case 2:
				accept(ks[i], true)
			case 3:
				for _, f := range m.Forget(ks[i]) {
					end(f.(ev), "forgotten")
				}
			case 4:
				h.settled(t) // no call of the key may accept beside the exit
				exits := make(chan fakeExit, 1)
				exits <- fakeExit{}
				mu.Lock()
				nextSeq[ks[i]]++
				e := ev{ks[i], nextSeq[ks[i]]}
				accepted[e] = true
				mu.Unlock()
				// The watcher accepts it; no other accept of the key runs
				// until done, so its seq is its place in the queue.
				mu.Lock()
				done := WatchExit(context.Background(), m, ks[i], exits, func(uint32, time.Time) any { return e })
				mu.Unlock()
				<-done
			case 5:
				h.settled(t)
			}
		}
		h.settled(t)
		s := m.Stats()
		assertBalanced(t, s)
		if s.KeysInBackoff == 0 {
			assert.False(t, h.clock.HasWaiters(), "round %d: idle, nothing in backoff, yet a timer: %+v", round, s)
		}
		if at, ok := m.NextRetry(); ok {
			h.clock.SetTime(at)
		}
	}
	h.settled(t)
	if seed%2 == 0 {
		_ = m.Shutdown(context.Background()) // drains the backoff at once
	} else {
		m.Stop()
	}
	for _, d := range h.drops.all() {
		for _, e := range d.Events {
			end(e.(ev), "dropped: "+d.Reason.Error())
		}
	}
	mu.Lock()
	defer mu.Unlock()
	assert.False(t, x.twice.Load(), "a key on two goroutines")
	assert.Empty(t, badOrder, "per-key order")
	assert.Empty(t, twice, "an event ended twice")
	for e := range accepted {
		if _, ok := ended[e]; !ok {
			t.Errorf("%v accepted, never ended (%d calls)", e, attempts[e])
		}
	}
	assertBalanced(t, m.Stats())
	require.Equal(t, uint64(len(accepted)), m.Stats().Received)
}
