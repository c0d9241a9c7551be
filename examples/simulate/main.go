// Command simulate runs the monitor against a simulated container runtime:
// containers start, exit and run out of memory, a flaky handler fails a
// fraction of its calls, and at the end every event produced is accounted
// for as handled, filtered or dropped with a reason.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/eventmonitor/eventmonitor"
	emprom "github.com/eventmonitor/eventmonitor/prometheus"
)

// The runtime's event types, registered with typeurl like containerd's.
type (
	ContainerStarted struct {
		ID  string
		Seq int
	}
	ContainerOOM struct {
		ID  string
		Seq int
	}
	ContainerExited struct {
		ID   string
		Seq  int
		Code uint32
	}
)

func init() {
	typeurl.Register(&ContainerStarted{}, "simulate", "ContainerStarted")
	typeurl.Register(&ContainerOOM{}, "simulate", "ContainerOOM")
	typeurl.Register(&ContainerExited{}, "simulate", "ContainerExited")
}

type options struct {
	rate       int
	fail       float64
	workers    int
	duration   time.Duration
	containers int
	backoff    time.Duration
	settle     time.Duration
	metrics    string
	logLevel   string
}

func main() {
	var o options
	flag.IntVar(&o.rate, "rate", 2000, "events per second the runtime produces")
	flag.Float64Var(&o.fail, "fail", 0.1, "fraction of handler calls that fail")
	flag.IntVar(&o.workers, "workers", 4, "handler goroutines")
	flag.DurationVar(&o.duration, "duration", 3*time.Second, "how long the runtime produces events")
	flag.IntVar(&o.containers, "containers", 200, "containers in the simulated runtime")
	flag.DurationVar(&o.backoff, "backoff", 50*time.Millisecond, "initial backoff (doubles up to 20x)")
	flag.DurationVar(&o.settle, "settle", 30*time.Second, "at most how long retries may run after the runtime stops; Shutdown follows as soon as every queue drained")
	flag.StringVar(&o.metrics, "metrics-addr", "", "serve Prometheus metrics on this address (e.g. localhost:9090) at /metrics")
	flag.StringVar(&o.logLevel, "log-level", "fatal", "the monitor's log level (error shows each simulated failure, info each retry too)")
	flag.Parse()
	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "simulate:", err)
		os.Exit(1)
	}
}

// handler fails a fraction of calls and checks that each container's events
// are handled in the order they were produced. The order is checked per
// path: an exit from WatchExit and an envelope sent just before it reach the
// monitor by different goroutines, so either may be accepted first.
type handler struct {
	fail float64

	mu        sync.Mutex
	lastSeq   map[string]int
	succeeded int
	reordered int
}

func (h *handler) HandleEvent(ctx context.Context, event any) error {
	var id string
	var seq int
	switch e := event.(type) {
	case *ContainerStarted:
		id, seq = e.ID, e.Seq
	case *ContainerOOM:
		id, seq = e.ID, e.Seq
	case *ContainerExited:
		id, seq = "exit/"+e.ID, e.Seq
	}
	if rand.Float64() < h.fail {
		return errors.New("simulated failure")
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if seq <= h.lastSeq[id] {
		h.reordered++
	}
	h.lastSeq[id] = seq
	h.succeeded++
	return nil
}

// runtime produces events into a channel the monitor subscribes to.
type runtime struct {
	events   chan *eventmonitor.Envelope
	produced int
	exits    int
	seq      map[string]int
}

func (r *runtime) Subscribe(ctx context.Context, filters ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
	return r.events, nil
}

func (r *runtime) next(id string) int {
	r.seq[id]++
	return r.seq[id]
}

func run(o options) error {
	// The summary lines tell the story: by default the monitor logs nothing,
	// as each simulated failure would be an error line.
	if err := log.SetLevel(o.logLevel); err != nil {
		return err
	}
	h := &handler{fail: o.fail, lastSeq: map[string]int{}}
	var dropMu sync.Mutex
	dropped := map[string]int{}
	collector := emprom.New()
	m, err := eventmonitor.New(h,
		eventmonitor.WithMetrics(collector),
		eventmonitor.WithNamespace("k8s.io"),
		eventmonitor.WithConverter(eventmonitor.NewConverter(
			eventmonitor.KeyOf(func(e *ContainerStarted) string { return e.ID }),
			eventmonitor.KeyOf(func(e *ContainerOOM) string { return e.ID }),
			eventmonitor.KeyOf(func(e *ContainerExited) string { return e.ID }),
		)),
		eventmonitor.WithWorkers(o.workers),
		eventmonitor.WithBackoff(o.backoff, 20*o.backoff),
		eventmonitor.WithDropHandler(func(d eventmonitor.Drop) {
			dropMu.Lock()
			defer dropMu.Unlock()
			dropped[emprom.Reason(d.Reason)] += max(1, len(d.Events))
		}),
	)
	if err != nil {
		return err
	}
	collector.Watch(m)
	if o.metrics != "" {
		stopServing, err := serveMetrics(o.metrics, collector)
		if err != nil {
			return err
		}
		defer stopServing()
	}
	rt := &runtime{events: make(chan *eventmonitor.Envelope), seq: map[string]int{}}
	ctx, stopRun := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- m.Run(ctx, rt) }()

	fmt.Printf("simulating %d containers at %d events/s for %v, %d workers, %.0f%% of calls failing\n",
		o.containers, o.rate, o.duration, o.workers, 100*o.fail)
	start := time.Now()
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	interval := time.Second / time.Duration(max(1, o.rate))
	next := start
	for time.Since(start) < o.duration {
		select {
		case <-tick.C:
			summary(time.Since(start), m.Stats())
		default:
		}
		if wait := time.Until(next); wait > 0 {
			time.Sleep(wait) // pacing the simulated runtime, not waiting for the monitor
		}
		next = next.Add(interval)
		produce(rt, m, rand.IntN(o.containers))
	}
	stopRun()
	if err := <-runDone; err != nil {
		return fmt.Errorf("run: %w", err)
	}
	// Let the backoff queues work off, for at most o.settle, before shutting
	// down; Shutdown then replays what is left once and drops what fails.
	settleStart := time.Now()
	for deadline := time.Now().Add(o.settle); time.Now().Before(deadline); {
		if s := m.Stats(); s.KeysInBackoff == 0 && s.Queued == 0 && s.InFlight == 0 {
			break
		}
		select {
		case <-tick.C:
			summary(time.Since(start), m.Stats())
		case <-time.After(10 * time.Millisecond): // polling a demo's progress
		}
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	settled := time.Since(settleStart)
	waiting := m.Stats()
	shutdownErr := m.Shutdown(shutdownCtx)
	summary(time.Since(start), m.Stats())
	if n := dropped[emprom.ReasonStopped]; n > 0 {
		fmt.Printf("\n%d events were still waiting for a retry (%d keys in backoff) when the demo shut down after\n"+
			"settling %v; Shutdown replayed them once and dropped the %d that failed again, with ErrStopped.\n"+
			"A longer -settle (now %v) lets their retries finish; a lower -fail makes fewer of them.\n",
			waiting.EventsInBackoff+waiting.Queued, waiting.KeysInBackoff, settled.Round(time.Millisecond), n, o.settle)
	} else {
		fmt.Printf("\nevery queue drained %v after the runtime stopped\n", settled.Round(time.Millisecond))
	}
	return account(rt, h, m.Stats(), dropped, shutdownErr)
}

// produce emits one event for container n: mostly starts and OOMs through the
// stream, sometimes an exit through WatchExit, sometimes an event of another
// namespace that the monitor must filter out.
func produce(rt *runtime, m *eventmonitor.Monitor, n int) {
	id := fmt.Sprintf("c%03d", n)
	rt.produced++
	var event any
	ns := "k8s.io"
	switch p := rand.IntN(100); {
	case p < 5:
		ns, event = "moby", &ContainerStarted{ID: id}
	case p < 15:
		rt.exits++
		exitCh := make(chan exitStatus, 1)
		exitCh <- exitStatus{code: uint32(rand.IntN(2)) * 137, at: time.Now()}
		seq := rt.next("exit/" + id)
		<-eventmonitor.WatchExit(context.Background(), m, id, exitCh, func(code uint32, at time.Time) any {
			return &ContainerExited{ID: id, Seq: seq, Code: code}
		})
		return
	case p < 25:
		event = &ContainerOOM{ID: id, Seq: rt.next(id)}
	default:
		event = &ContainerStarted{ID: id, Seq: rt.next(id)}
	}
	payload, err := typeurl.MarshalAnyToProto(event)
	if err != nil {
		panic(err) // registered types always marshal
	}
	rt.events <- &eventmonitor.Envelope{Timestamp: time.Now(), Namespace: ns, Topic: "/simulate", Event: payload}
}

type exitStatus struct {
	code uint32
	at   time.Time
}

func (s exitStatus) Result() (uint32, time.Time, error) { return s.code, s.at, nil }

func summary(at time.Duration, s eventmonitor.Stats) {
	fmt.Printf("%5.1fs  received %7d  handled %7d  failed %6d  retried %6d  in backoff %4d keys / %5d events  queued %4d\n",
		at.Seconds(), s.Received, s.Handled, s.Failed, s.Retried, s.KeysInBackoff, s.EventsInBackoff, s.Queued)
}

// serveMetrics serves the collector at /metrics on addr until the returned
// function is called.
func serveMetrics(addr string, c *emprom.Collector) (stop func(), err error) {
	registry := prometheus.NewRegistry()
	registry.MustRegister(c)
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))
	listener, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	server := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go server.Serve(listener) //nolint:errcheck // ErrServerClosed once stop runs
	fmt.Printf("serving metrics at http://%s/metrics\n", listener.Addr())
	return func() { server.Close() }, nil
}

// account checks that every event produced is handled, filtered or dropped,
// and that no container's events were handled out of order.
func account(rt *runtime, h *handler, s eventmonitor.Stats, dropped map[string]int, shutdownErr error) error {
	totalDropped := 0
	fmt.Println("\nfinal accounting")
	line := func(label string, n any, note string) { fmt.Printf("  %-30s %8v  %s\n", label, n, note) }
	line("produced by the runtime", rt.produced, fmt.Sprintf("(%d exits via WatchExit)", rt.exits))
	line("handled successfully", s.Handled, fmt.Sprintf("(the handler counted %d)", h.succeeded))
	line("filtered (other namespace)", s.Filtered, "")
	line("ignored (type not keyed)", s.Ignored, "")
	for r, n := range dropped {
		line("dropped: "+r, n, "")
		totalDropped += n
	}
	line("still pending", s.Queued+s.EventsInBackoff+s.InFlight, "")
	line("failed calls", s.Failed, fmt.Sprintf("(%d backoff replays)", s.Retried))
	var problems []error
	if got := int(s.Handled) + int(s.Filtered) + int(s.Ignored) + totalDropped; got != rt.produced || int(s.Received) != rt.produced {
		problems = append(problems, fmt.Errorf("%d produced, %d received, but %d accounted for", rt.produced, s.Received, got))
	}
	if int(s.Handled) != h.succeeded {
		problems = append(problems, fmt.Errorf("monitor counted %d handled, handler %d", s.Handled, h.succeeded))
	}
	if h.reordered > 0 {
		problems = append(problems, fmt.Errorf("%d events handled out of order", h.reordered))
	}
	if shutdownErr != nil {
		problems = append(problems, shutdownErr)
	}
	if err := errors.Join(problems...); err != nil {
		return err
	}
	fmt.Println("every event is accounted for, in order per container")
	return nil
}
