// Command hybrid shows the hybrid mode of kubelet's Evented PLEG, built from
// eventmonitor's parts: a Monitor handles the runtime's event stream, a
// relister runs at a long period as a safety net, and the monitor's resync
// hook relists at once when a stream comes back after an outage. The simulated runtime
// loses a fraction of its events and breaks its stream now and then; at the
// end the handler's view of every container must match the runtime's.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"time"

	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/relist"
)

// StateChanged is the runtime's stream event: a container changed state.
type StateChanged struct {
	Pod, Container string
	State          relist.State
}

func init() { typeurl.Register(&StateChanged{}, "hybrid", "StateChanged") }

// runtime is a simulated runtime: pods with one container each, a stream
// that loses events and breaks, and a listing that is always right.
type runtime struct {
	mu      sync.Mutex
	states  map[string]relist.State // pod -> its container's state
	lost    int
	breaks  int
	streams chan chan *eventmonitor.Envelope
	errs    chan error
}

func (rt *runtime) Subscribe(ctx context.Context, _ ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
	ch, errs := make(chan *eventmonitor.Envelope, 64), make(chan error, 1)
	rt.mu.Lock()
	rt.errs = errs
	rt.mu.Unlock()
	rt.streams <- ch
	return ch, errs
}

func (rt *runtime) List(ctx context.Context) ([]relist.Pod, error) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	pods := make([]relist.Pod, 0, len(rt.states))
	for pod, state := range rt.states {
		pods = append(pods, relist.Pod{ID: pod, Containers: []relist.Container{{ID: pod + "-app", State: state}}})
	}
	return pods, nil
}

// view is what the handler believes about each container. It tells the
// relister what the stream said, so a relist compares the listing with that.
type view struct {
	relister   *relist.Relister
	mu         sync.Mutex
	states     map[string]relist.State
	fromRelist int
}

func (v *view) HandleEvent(ctx context.Context, event any) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	switch e := event.(type) {
	case *StateChanged:
		v.states[e.Pod] = e.State
		v.relister.Observe(e.Pod, relist.Container{ID: e.Container, State: e.State})
	case relist.Event:
		v.fromRelist++
		switch e.Type {
		case relist.ContainerStarted:
			v.states[e.PodID] = relist.StateRunning
		case relist.ContainerDied:
			v.states[e.PodID] = relist.StateExited
		}
	}
	return nil
}

func main() {
	pods := flag.Int("pods", 50, "pods in the simulated runtime")
	lose := flag.Float64("lose", 0.1, "fraction of stream events lost")
	duration := flag.Duration("duration", 3*time.Second, "how long the runtime changes")
	flag.Parse()
	log.L.Logger.SetLevel(log.ErrorLevel)
	if err := run(*pods, *lose, *duration); err != nil {
		fmt.Fprintln(os.Stderr, "hybrid:", err)
		os.Exit(1)
	}
}

func run(pods int, lose float64, duration time.Duration) error {
	rt := &runtime{states: map[string]relist.State{}, streams: make(chan chan *eventmonitor.Envelope, 1)}
	for i := range pods {
		rt.states[fmt.Sprintf("pod-%02d", i)] = relist.StateRunning
	}
	v := &view{states: map[string]relist.State{}}
	var r *relist.Relister
	m, err := eventmonitor.New(v, eventmonitor.WithWorkers(4),
		eventmonitor.WithConverter(eventmonitor.NewConverter(
			eventmonitor.KeyOf(func(e *StateChanged) string { return e.Pod }))),
		eventmonitor.WithResubscribe(10*time.Millisecond, 100*time.Millisecond),
		eventmonitor.WithResync(func(ctx context.Context) error { return r.Relist(ctx) }))
	if err != nil {
		return err
	}
	r = relist.New(rt.List, relist.ToMonitor(m), relist.WithPeriod(2*time.Second))
	v.relister = r
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); r.Run(ctx) }()
	go func() { defer wg.Done(); _ = m.Run(ctx, rt) }()

	stream := <-rt.streams
	for start := time.Now(); time.Since(start) < duration; time.Sleep(time.Millisecond) {
		pod := fmt.Sprintf("pod-%02d", rand.IntN(pods))
		rt.mu.Lock()
		state := relist.StateExited
		if rt.states[pod] == relist.StateExited {
			state = relist.StateRunning
		}
		rt.states[pod] = state
		lost := rand.Float64() < lose
		if lost {
			rt.lost++
		}
		breakNow := rand.IntN(500) == 0
		if breakNow {
			rt.breaks++
			rt.errs <- errors.New("stream broke")
		}
		rt.mu.Unlock()
		if breakNow {
			stream = <-rt.streams
		}
		if !lost {
			payload, err := typeurl.MarshalAnyToProto(&StateChanged{Pod: pod, Container: pod + "-app", State: state})
			if err != nil {
				return err
			}
			stream <- &eventmonitor.Envelope{Namespace: "default", Topic: "/state", Event: payload}
		}
	}
	// The stream goes quiet; the safety-net relist catches up within its period.
	deadline := time.Now().Add(5 * time.Second)
	for ; time.Now().Before(deadline) && mismatches(rt, v) > 0; time.Sleep(50 * time.Millisecond) {
	}
	cancel()
	wg.Wait()
	if err := m.Shutdown(context.Background()); err != nil {
		return err
	}
	n := mismatches(rt, v)
	fmt.Printf("%d pods; %d stream events lost, %d stream breaks; %d relist events handled; %d containers disagree\n",
		pods, rt.lost, rt.breaks, v.fromRelist, n)
	if n > 0 {
		return fmt.Errorf("%d containers disagree with the runtime", n)
	}
	fmt.Println("every lost event was recovered by a relist")
	return nil
}

func mismatches(rt *runtime, v *view) int {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	v.mu.Lock()
	defer v.mu.Unlock()
	n := 0
	for pod, state := range rt.states {
		if v.states[pod] != state {
			n++
		}
	}
	return n
}
