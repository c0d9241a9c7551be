package eventmonitor

// Stop: what it hands over, what it abandons, and Stop racing everything else.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// At Stop a key's queue goes out as one Drop per run of the same topic and
// namespace, in order.
func TestStopDropsRunsByOrigin(t *testing.T) {
	first := make(chan struct{})
	var once sync.Once
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		once.Do(func() { close(first) })
		<-ctx.Done() // the first call holds the key until Stop
		return ctx.Err()
	}), WithConverter(testConverter))
	stream := newFakeStream()
	h.m.Subscribe(stream)
	h.m.Start()
	sub := <-stream.newSub
	n := 0
	send := func(topic, ns string) {
		n++
		sub.send(t, &Envelope{Topic: topic, Namespace: ns, Event: payload(t, &jsonEvent{ID: "k", Code: n})})
		want := uint64(n)
		waitFor(t, func() bool { return h.m.Stats().Received == want }, "envelope %d accepted", n)
	}
	submit := func() {
		n++
		require.NoError(t, h.m.Submit("k", &jsonEvent{ID: "k", Code: n}))
	}
	send("/a", "ns") // 1: in flight
	<-first
	send("/a", "ns") // 2
	send("/a", "ns") // 3
	submit()         // 4
	send("/b", "ns") // 5
	send("/a", "ns") // 6
	send("", "")     // 7: an envelope with no topic or namespace
	submit()         // 8
	send("/a", "ns") // 9
	h.m.Stop()

	drops := h.drops.all()
	type group struct {
		topic, ns string
		codes     []int
	}
	var got []group
	for _, d := range drops {
		var codes []int
		for _, e := range d.Events {
			codes = append(codes, e.(*jsonEvent).Code)
		}
		assert.Equal(t, "k", d.Key)
		assert.ErrorIs(t, d.Reason, ErrStopped)
		got = append(got, group{d.Topic, d.Namespace, codes})
	}
	assert.Equal(t, []group{
		{"/a", "ns", []int{1}}, // failed while shutting down
		{"/a", "ns", []int{2, 3}},
		{"", "", []int{4}},
		{"/b", "ns", []int{5}},
		{"/a", "ns", []int{6}},
		{"", "", []int{7, 8}},
		{"/a", "ns", []int{9}},
	}, got)
	assertBalanced(t, h.m.Stats())
}

// Real clock, tiny timeouts: calls go late, overrun, are replaced and
// abandoned while events, backoffs and exits keep coming and Stop or
// Shutdown races them. Stop returns, everything is accounted for, no key
// runs twice, no goroutine of the monitor outlives Stop, no timer is set.
func TestStopRacesOverrunsAndRetriesOnTheRealClock(t *testing.T) {
	for i := 0; i < 40; i++ {
		stopRaceRun(t, uint64(i))
	}
	goleak.VerifyNone(t)
}

func stopRaceRun(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 11))
	var rmu sync.Mutex
	rnd := func(n int) int { rmu.Lock(); defer rmu.Unlock(); return rng.IntN(n) }
	stuck := make(chan struct{})
	var keys exclusive
	var emitted atomic.Int64
	m, err := New(HandlerFunc(func(ctx context.Context, e any) error {
		defer keys.enter(keyOf(e))()
		switch rnd(6) {
		case 0:
			return errors.New("fail")
		case 1:
			<-ctx.Done()
			return ctx.Err()
		case 2:
			<-stuck // ignores its ctx: overruns, is replaced, abandoned at Stop
		}
		return nil
	}), WithWorkers(1+int(seed%3)), WithHandleTimeout(time.Duration(1+seed%3)*time.Millisecond),
		WithMaxOverruns(int(seed%2)), WithBackoff(time.Millisecond, 4*time.Millisecond),
		WithDropHandler(func(d Drop) { emitted.Add(int64(max(1, len(d.Events)))) }), WithLogger(quietLogger()))
	require.NoError(t, err)
	var feeders sync.WaitGroup
	for f := 0; f < 3; f++ {
		feeders.Add(1)
		go func() {
			defer feeders.Done()
			for j := 0; j < 60; j++ {
				k := fmt.Sprintf("k%d", rnd(6))
				switch rnd(4) {
				case 0:
					m.Backoff(k, ev{k, j})
				case 1:
					ch := make(chan fakeExit, 1)
					ch <- fakeExit{}
					WatchExit(context.Background(), m, k, ch, func(uint32, time.Time) any { return ev{k, j} })
				default:
					_ = m.Submit(k, ev{k, j})
				}
			}
		}()
	}
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		if seed%2 == 0 {
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rnd(5))*time.Millisecond)
			defer cancel()
			_ = m.Shutdown(ctx)
		} else {
			m.Stop()
		}
	}()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		close(stuck)
		t.Fatalf("seed %d: Stop/Shutdown hangs: %+v", seed, m.Stats())
	}
	feeders.Wait()
	close(stuck)
	require.False(t, keys.twice.Load(), "seed %d: a key on two goroutines", seed)
	s := m.Stats()
	assertBalanced(t, s)
	require.Zero(t, s.Queued+s.EventsInBackoff+s.InFlight, "seed %d: %+v", seed, s)
	require.Equal(t, s.Dropped, uint64(emitted.Load()), "seed %d: drops counted vs handed over", seed)
	m.mu.Lock()
	require.True(t, m.sched.at.IsZero(), "seed %d: timer set after Stop", seed)
	require.Empty(t, m.calls)
	m.mu.Unlock()
}
