package relist

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	testclock "k8s.io/utils/clock/testing"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// runtime is a listing the test edits between relists.
type runtime struct {
	mu   sync.Mutex
	pods []Pod
	err  error
}

func (rt *runtime) set(pods ...Pod) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	rt.pods = pods
}

func (rt *runtime) list(ctx context.Context) ([]Pod, error) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	if rt.err != nil {
		return nil, rt.err
	}
	out := make([]Pod, len(rt.pods))
	for i, p := range rt.pods {
		out[i] = Pod{ID: p.ID, Containers: append([]Container(nil), p.Containers...)}
	}
	return out, nil
}

// sink records events; fail makes the next n calls for an event fail.
type sink struct {
	mu     sync.Mutex
	events []Event
	fail   map[Event]int
}

func (s *sink) add(ctx context.Context, e Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail[e] > 0 {
		s.fail[e]--
		return errors.New("sink refused")
	}
	s.events = append(s.events, e)
	return nil
}

func (s *sink) take() []Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.events
	s.events = nil
	return out
}

// takeByPod is take with the events grouped by pod: pods are applied in
// parallel, so only each pod's own order is guaranteed.
func (s *sink) takeByPod() []Event {
	events := s.take()
	slices.SortStableFunc(events, func(a, b Event) int { return strings.Compare(a.PodID, b.PodID) })
	return events
}

func pod(id string, containers ...Container) Pod { return Pod{ID: id, Containers: containers} }
func c(id string, s State) Container             { return Container{ID: id, State: s} }

func TestTransitions(t *testing.T) {
	states := []State{StateRunning, StateExited, StateUnknown, StateNonExistent}
	want := map[[2]State][]EventType{
		{StateRunning, StateExited}:      {ContainerDied},
		{StateRunning, StateUnknown}:     {ContainerChanged},
		{StateRunning, StateNonExistent}: {ContainerDied, ContainerRemoved},
		{StateExited, StateRunning}:      {ContainerStarted},
		{StateExited, StateUnknown}:      {ContainerChanged},
		{StateExited, StateNonExistent}:  {ContainerRemoved},
		{StateUnknown, StateRunning}:     {ContainerStarted},
		{StateUnknown, StateExited}:      {ContainerDied},
		{StateUnknown, StateNonExistent}: {ContainerDied, ContainerRemoved},
		{StateNonExistent, StateRunning}: {ContainerStarted},
		{StateNonExistent, StateExited}:  {ContainerDied},
		{StateNonExistent, StateUnknown}: {ContainerChanged},
	}
	for _, changed := range []bool{true, false} {
		for _, from := range states {
			for _, to := range states {
				t.Run(fmt.Sprintf("%s-%s-changed-%v", from, to, changed), func(t *testing.T) {
					listing := func(s State) Pod {
						if s == StateNonExistent {
							return pod("p", c("sandbox", StateRunning))
						}
						return pod("p", c("sandbox", StateRunning), c("c1", s))
					}
					rt, out := &runtime{}, &sink{}
					r := New(rt.list, out.add, WithChangedEvents(changed))
					rt.set(listing(from))
					require.NoError(t, r.Relist(context.Background()))
					out.take()
					rt.set(listing(to))
					require.NoError(t, r.Relist(context.Background()))
					var types []EventType
					for _, e := range out.take() {
						assert.Equal(t, "c1", e.ContainerID)
						assert.Equal(t, "p", e.PodID)
						types = append(types, e.Type)
					}
					expected := want[[2]State{from, to}]
					if !changed && to == StateUnknown {
						expected = nil
					}
					assert.Equal(t, expected, types)
				})
			}
		}
	}
}

func TestPodsAppearChangeAndDisappear(t *testing.T) {
	rt, out := &runtime{}, &sink{}
	r := New(rt.list, out.add)
	ctx := context.Background()

	rt.set(pod("p1", c("s1", StateRunning), c("a", StateRunning)))
	require.NoError(t, r.Relist(ctx))
	assert.Equal(t, []Event{{"p1", ContainerStarted, "s1"}, {"p1", ContainerStarted, "a"}}, out.take())

	require.NoError(t, r.Relist(ctx))
	assert.Empty(t, out.take(), "nothing changed")

	rt.set(pod("p1", c("s1", StateRunning), c("a", StateExited), c("b", StateRunning)), pod("p2", c("s2", StateExited)))
	require.NoError(t, r.Relist(ctx))
	assert.Equal(t, []Event{{"p1", ContainerDied, "a"}, {"p1", ContainerStarted, "b"}, {"p2", ContainerDied, "s2"}}, out.takeByPod())

	rt.set(pod("p2", c("s2", StateExited)))
	require.NoError(t, r.Relist(ctx))
	assert.Equal(t, []Event{
		{"p1", ContainerDied, "s1"}, {"p1", ContainerRemoved, "s1"},
		{"p1", ContainerRemoved, "a"},
		{"p1", ContainerDied, "b"}, {"p1", ContainerRemoved, "b"},
	}, out.take())
}

func TestFailedInspectIsRetriedAndLosesNothing(t *testing.T) {
	rt, out := &runtime{}, &sink{}
	var mu sync.Mutex
	inspected := map[string]int{}
	failing := map[string]bool{"p1": true}
	r := New(rt.list, out.add, WithInspect(func(ctx context.Context, id string, p *Pod) error {
		mu.Lock()
		defer mu.Unlock()
		inspected[id]++
		if failing[id] {
			return errors.New("runtime busy")
		}
		return nil
	}))
	ctx := context.Background()
	rt.set(pod("p1", c("a", StateRunning)), pod("p2", c("b", StateRunning)))
	err := r.Relist(ctx)
	require.ErrorContains(t, err, "inspect pod p1")
	assert.Equal(t, []Event{{"p2", ContainerStarted, "b"}}, out.take(), "p1's events wait for a good inspection")

	require.Error(t, r.Relist(ctx))
	assert.Empty(t, out.take())
	mu.Lock()
	assert.Equal(t, map[string]int{"p1": 2, "p2": 1}, inspected, "p1 is inspected again every relist; p2 once")
	mu.Unlock()

	mu.Lock()
	failing["p1"] = false
	mu.Unlock()
	require.NoError(t, r.Relist(ctx))
	assert.Equal(t, []Event{{"p1", ContainerStarted, "a"}}, out.take())
	require.NoError(t, r.Relist(ctx))
	assert.Empty(t, out.take())
	assert.Equal(t, 3, inspected["p1"])
}

func TestFailedSinkEmitsAgain(t *testing.T) {
	rt := &runtime{}
	out := &sink{fail: map[Event]int{{"p1", ContainerRemoved, "a"}: 1}}
	r := New(rt.list, out.add)
	ctx := context.Background()
	rt.set(pod("p1", c("a", StateRunning)))
	require.NoError(t, r.Relist(ctx))
	out.take()
	rt.set()
	require.ErrorContains(t, r.Relist(ctx), "sink refused")
	assert.Equal(t, []Event{{"p1", ContainerDied, "a"}}, out.take())
	require.NoError(t, r.Relist(ctx))
	assert.Equal(t, []Event{{"p1", ContainerDied, "a"}, {"p1", ContainerRemoved, "a"}}, out.take(),
		"the pod kept its record: its events come again (delayed, never lost)")
	require.NoError(t, r.Relist(ctx))
	assert.Empty(t, out.take())
}

func TestListErrorChangesNothing(t *testing.T) {
	rt, out := &runtime{}, &sink{}
	r := New(rt.list, out.add)
	rt.set(pod("p1", c("a", StateRunning)))
	require.NoError(t, r.Relist(context.Background()))
	out.take()
	rt.err = errors.New("runtime down")
	require.ErrorIs(t, r.Relist(context.Background()), rt.err)
	rt.err = nil
	require.NoError(t, r.Relist(context.Background()))
	assert.Empty(t, out.take())
}

func TestHealthy(t *testing.T) {
	clk := testclock.NewFakeClock(epoch)
	rt, out := &runtime{}, &sink{}
	r := New(rt.list, out.add, WithClock(clk), WithThreshold(time.Minute))
	require.Error(t, r.Healthy(), "unhealthy before the first relist")
	require.NoError(t, r.Relist(context.Background()))
	require.NoError(t, r.Healthy())
	clk.Step(time.Minute)
	require.NoError(t, r.Healthy())
	clk.Step(time.Nanosecond)
	require.ErrorContains(t, r.Healthy(), "threshold")
	rt.err = errors.New("down")
	require.Error(t, r.Relist(context.Background()))
	require.Error(t, r.Healthy(), "a relist that cannot list does not count")
}

func TestInspectionsRunInParallel(t *testing.T) {
	const pods, workers = 200, 4
	var mu sync.Mutex
	running, most, done := 0, 0, 0
	release := make(chan struct{})
	rt, out := &runtime{}, &sink{}
	r := New(rt.list, out.add, WithInspectWorkers(workers), WithInspect(func(ctx context.Context, id string, p *Pod) error {
		mu.Lock()
		running++
		most = max(most, running)
		mu.Unlock()
		<-release
		mu.Lock()
		running--
		done++
		mu.Unlock()
		return nil
	}))
	var listing []Pod
	for i := range pods {
		listing = append(listing, pod(fmt.Sprintf("p%d", i), c(fmt.Sprintf("c%d", i), StateRunning)))
	}
	rt.set(listing...)
	relisted := make(chan error)
	go func() { relisted <- r.Relist(context.Background()) }()
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return running == workers }, 10*time.Second, time.Millisecond)
	close(release)
	require.NoError(t, <-relisted)
	assert.Equal(t, workers, most, "exactly the configured number of inspections at once")
	assert.Equal(t, pods, done)
	assert.Len(t, out.take(), pods)
}

func TestRunRelistsEveryPeriod(t *testing.T) {
	clk := testclock.NewFakeClock(epoch)
	rt, out := &runtime{}, &sink{}
	var mu sync.Mutex
	lists := 0
	list := func(ctx context.Context) ([]Pod, error) {
		mu.Lock()
		lists++
		mu.Unlock()
		return rt.list(ctx)
	}
	count := func() int { mu.Lock(); defer mu.Unlock(); return lists }
	r := New(list, out.add, WithClock(clk), WithPeriod(time.Second))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	require.Eventually(t, func() bool { return count() == 1 }, 10*time.Second, time.Millisecond, "relists at once")
	for i := 2; i <= 4; i++ {
		require.Eventually(t, clk.HasWaiters, 10*time.Second, time.Millisecond)
		clk.Step(time.Second)
		require.Eventually(t, func() bool { return count() == i }, 10*time.Second, time.Millisecond, "relist %d", i)
	}
	cancel()
	<-done
}

func TestObserveMakesTheNextRelistCompareWithTheStream(t *testing.T) {
	rt, out := &runtime{}, &sink{}
	r := New(rt.list, out.add)
	ctx := context.Background()
	rt.set(pod("p1", c("a", StateExited)))
	require.NoError(t, r.Relist(ctx))
	out.take()

	// The stream reports a restart, then loses the next exit: the runtime
	// lists exited again, as at the last relist.
	r.Observe("p1", c("a", StateRunning))
	require.NoError(t, r.Relist(ctx))
	assert.Equal(t, []Event{{"p1", ContainerDied, "a"}}, out.take())

	// A container and a pod first heard of on the stream.
	r.Observe("p1", c("b", StateRunning))
	r.Observe("p2", c("x", StateRunning))
	r.Observe("p3", c("gone", StateNonExistent))
	require.NoError(t, r.Relist(ctx))
	assert.ElementsMatch(t, []Event{
		{"p1", ContainerDied, "b"}, {"p1", ContainerRemoved, "b"},
		{"p2", ContainerDied, "x"}, {"p2", ContainerRemoved, "x"},
	}, out.take())

	r.Observe("p1", c("a", StateNonExistent))
	require.NoError(t, r.Relist(ctx))
	assert.Equal(t, []Event{{"p1", ContainerDied, "a"}}, out.take(), "a reappears as listed: exited")
}
