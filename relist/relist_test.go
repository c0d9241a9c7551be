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
	assert.Equal(t, []Event{{"p1", ContainerDied, "a"}, {"p1", ContainerStarted, "b"}, {"p2", ContainerDied, "s2"}}, out.take())

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

// A sink that fails gets the event it refused again next relist, and the
// pod's later events after it, but never one it already took.
func TestFailedSinkResumesWhereItStopped(t *testing.T) {
	for _, tc := range []struct {
		name        string
		before      []Container
		refused     Event
		first, then []Event
	}{
		{"a container's second event", []Container{c("a", StateRunning)}, Event{"p1", ContainerRemoved, "a"},
			[]Event{{"p1", ContainerDied, "a"}}, []Event{{"p1", ContainerRemoved, "a"}}},
		{"a later container's", []Container{c("a", StateRunning), c("b", StateRunning)}, Event{"p1", ContainerDied, "b"},
			[]Event{{"p1", ContainerDied, "a"}, {"p1", ContainerRemoved, "a"}},
			[]Event{{"p1", ContainerDied, "b"}, {"p1", ContainerRemoved, "b"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rt := &runtime{}
			out := &sink{fail: map[Event]int{tc.refused: 1}}
			r := New(rt.list, out.add)
			ctx := context.Background()
			rt.set(pod("p1", tc.before...))
			require.NoError(t, r.Relist(ctx))
			out.take()
			rt.set() // the pod is gone
			require.ErrorContains(t, r.Relist(ctx), "sink refused")
			assert.Equal(t, tc.first, out.take())
			require.NoError(t, r.Relist(ctx))
			assert.Equal(t, tc.then, out.take(), "the refused event comes again (delayed, never lost), and only what followed it")
			require.NoError(t, r.Relist(ctx))
			assert.Empty(t, out.take())
		})
	}
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

// containerd's CRI lists a pod's containers in Go map order: a pod whose
// listing only changed order has not changed, and is neither diffed nor
// inspected again (kubelet compares by container ID too).
func TestReorderedPodIsUnchanged(t *testing.T) {
	for _, size := range []int{2, scanLimit + 4} { // scanned, and looked up by ID
		t.Run(fmt.Sprint(size, " containers"), func(t *testing.T) {
			var containers []Container
			for i := range size {
				containers = append(containers, c(fmt.Sprint("c", i), StateRunning))
			}
			reversed := slices.Clone(containers)
			slices.Reverse(reversed)
			rt, out := &runtime{}, &sink{}
			inspections := 0
			r := New(rt.list, out.add, WithInspect(func(context.Context, string, *Pod) error { inspections++; return nil }))
			ctx := context.Background()
			for i := range 10 {
				if i%2 == 0 {
					rt.set(pod("p", containers...))
				} else {
					rt.set(pod("p", reversed...))
				}
				require.NoError(t, r.Relist(ctx))
			}
			assert.Equal(t, 1, inspections, "inspected when it appeared, not for reordering")
			assert.Len(t, out.take(), size, "one Started per container, nothing for reordering")

			// A change in a reordered listing is still one.
			changed := slices.Clone(reversed)
			changed[size-1].State = StateExited // c0, last in the reversed order
			rt.set(pod("p", changed...))
			require.NoError(t, r.Relist(ctx))
			assert.Equal(t, []Event{{"p", ContainerDied, "c0"}}, out.take())
			assert.Equal(t, 2, inspections)

			// A container turning unknown is re-inspected, as kubelet does,
			// though WithChangedEvents is off and no event is emitted.
			unknown := slices.Clone(changed)
			unknown[0].State = StateUnknown
			slices.Reverse(unknown)
			rt.set(pod("p", unknown...))
			require.NoError(t, r.Relist(ctx))
			assert.Empty(t, out.take())
			assert.Equal(t, 3, inspections)
		})
	}
}

// The sink is called from one goroutine, in listing order, even when
// inspections finish in the opposite order: a sink that appends to a slice
// without a lock is safe (the race detector checks it).
func TestSinkIsCalledInOrderFromOneGoroutine(t *testing.T) {
	const pods = 30
	inspected := make([]chan struct{}, pods+1)
	for i := range inspected {
		inspected[i] = make(chan struct{})
	}
	close(inspected[pods])
	var listing []Pod
	for i := range pods {
		listing = append(listing, pod(fmt.Sprint("p", i), c(fmt.Sprint("a", i), StateRunning), c(fmt.Sprint("b", i), StateExited)))
	}
	rt := &runtime{}
	rt.set(listing...)
	var events []Event // no lock: the sink must not be called concurrently
	r := New(rt.list, func(_ context.Context, e Event) error { events = append(events, e); return nil },
		WithInspectWorkers(pods),
		WithInspect(func(_ context.Context, id string, _ *Pod) error {
			var i int
			fmt.Sscanf(id, "p%d", &i)
			<-inspected[i+1] // the last pod's inspection finishes first
			close(inspected[i])
			return nil
		}))
	require.NoError(t, r.Relist(context.Background()))
	var want []Event
	for i := range pods {
		want = append(want, Event{fmt.Sprint("p", i), ContainerStarted, fmt.Sprint("a", i)},
			Event{fmt.Sprint("p", i), ContainerDied, fmt.Sprint("b", i)})
	}
	assert.Equal(t, want, events)

	// Pods gone from the listing come last, by ID.
	rt.set(listing[5:10]...)
	r.inspect = nil
	events = nil
	require.NoError(t, r.Relist(context.Background()))
	var gone []string
	for _, e := range events {
		if e.Type == ContainerRemoved && !slices.Contains(gone, e.PodID) {
			gone = append(gone, e.PodID)
		}
	}
	assert.True(t, slices.IsSortedFunc(gone, strings.Compare), "gone pods in ID order: %v", gone)
	assert.Len(t, gone, pods-5)
}

func TestNewPanicsOnNil(t *testing.T) {
	list := func(context.Context) ([]Pod, error) { return nil, nil }
	sink := func(context.Context, Event) error { return nil }
	assert.PanicsWithValue(t, "relist: New with a nil ListFunc", func() { New(nil, sink) })
	assert.PanicsWithValue(t, "relist: New with a nil sink", func() { New(list, nil) })
}
