//go:build unix

package containerd_test

// Benchmarks of the container informer against the in-process fake daemon:
// memory per cached container, a full relist and diff, and the CPU per
// stream event beside a bare monitor's and a bare gRPC loop's. CPU figures
// (cpu-ns/...) are the process's rusage over the timed loop, the fake's
// serving included: compare them with the bare loop's and listing-only's.
//
//	go test -run '^$' -bench 'Informer|PerEvent' -count 5 .

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/api/events"
	containersapi "github.com/containerd/containerd/api/services/containers/v1"
	eventsapi "github.com/containerd/containerd/api/services/events/v1"
	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	apitypes "github.com/containerd/containerd/api/types"
	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
	"github.com/eventmonitor/eventmonitor/containerd/internal/fakecontainerd"
)

// benchContainer is container i as the CRI plugin records a pod's
// container: a 64-hex ID, an image by registry path, runc v2, and the eight
// labels kubelet and the image give it (values of realistic length, those
// naming the pod unique to it).
func benchContainer(i int) fakecontainerd.Container {
	id := fmt.Sprintf("%064x", uint64(i)*0x9e3779b97f4a7c15+1)
	pod := fmt.Sprintf("frontend-7d9f8b6c5d-%05d", i)
	return fakecontainerd.Container{
		ID:      id,
		Image:   "registry.example.com/shop/frontend:v1.24.3",
		Runtime: "io.containerd.runc.v2",
		Labels: map[string]string{
			"io.cri-containerd.kind":          "container",
			"io.kubernetes.container.name":    "frontend",
			"io.kubernetes.pod.name":          pod,
			"io.kubernetes.pod.namespace":     "default",
			"io.kubernetes.pod.uid":           fmt.Sprintf("5f0c7e8a-3b1d-4c2e-9f6a-%012x", i),
			"app.kubernetes.io/name":          "frontend",
			"pod-template-hash":               "7d9f8b6c5d",
			"org.opencontainers.image.source": "https://github.com/example/shop-frontend",
		},
	}
}

// benchPopulate records n containers, each with a running task, and
// returns their IDs.
func benchPopulate(ns fakecontainerd.Namespace, n int) []string {
	ids := make([]string, n)
	for i := range ids {
		c := benchContainer(i)
		ids[i] = c.ID
		ns.CreateContainer(c)
		ns.CreateTask(c.ID, uint32(10_000+i))
		ns.StartTask(c.ID)
	}
	return ids
}

// benchFilters are the filters the container informer subscribes with, for
// the baselines to ask the fake for the same stream.
func benchFilters(b *testing.B) []string {
	filters, err := containerd.Filters(containerd.K8sNamespace,
		eventmonitor.KeyOf(func(e *events.ContainerCreate) string { return e.ID }),
		eventmonitor.KeyOf(func(e *events.ContainerUpdate) string { return e.ID }),
		eventmonitor.KeyOf(func(e *events.ContainerDelete) string { return e.ID }),
		eventmonitor.KeyOf(func(e *events.TaskCreate) string { return e.ContainerID }),
		eventmonitor.KeyOf(func(e *events.TaskStart) string { return e.ContainerID }),
		eventmonitor.KeyOf(func(e *events.TaskPaused) string { return e.ContainerID }),
		eventmonitor.KeyOf(func(e *events.TaskResumed) string { return e.ContainerID }),
		eventmonitor.KeyOf(func(e *events.TaskOOM) string { return e.ContainerID }),
		eventmonitor.KeyOf(func(e *events.TaskExit) string { return e.ContainerID }),
		eventmonitor.KeyOf(func(e *events.TaskDelete) string { return e.ContainerID }),
	)
	if err != nil {
		b.Fatal(err)
	}
	return filters
}

// benchRelisted is a logger that signals every relist the informer applies
// (its "relist applied" debug line) and writes nothing: a wait on the
// relist that neither polls Stats nor sleeps.
type benchRelisted chan struct{}

const benchRelistLine = "containerd: relist applied"

func (benchRelisted) Levels() []logrus.Level { return []logrus.Level{logrus.DebugLevel} }

func (r benchRelisted) Fire(e *logrus.Entry) error {
	if e.Message == benchRelistLine {
		select {
		case r <- struct{}{}:
		default:
		}
	}
	return nil
}

type benchNoFormat struct{}

func (benchNoFormat) Format(*logrus.Entry) ([]byte, error) { return nil, nil }

func (r benchRelisted) logger() *log.Entry {
	l := logrus.New()
	l.SetOutput(io.Discard)
	l.SetFormatter(benchNoFormat{})
	l.SetLevel(logrus.DebugLevel)
	l.AddHook(r)
	return logrus.NewEntry(l)
}

// wait waits for the next relist applied.
func (r benchRelisted) wait(b *testing.B) {
	select {
	case <-r:
	case <-time.After(time.Minute):
		b.Fatalf("no %q line in a minute: did the informer's log line change?", benchRelistLine)
	}
}

func benchQuiet() *log.Entry {
	l := logrus.New()
	l.SetOutput(io.Discard)
	return logrus.NewEntry(l)
}

// benchRun runs inf until the benchmark (one run of its function) ends.
func benchRun(b *testing.B, inf *containerd.Informer[containerd.Container]) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- inf.Run(ctx) }()
	stopped := false
	stop = func() {
		if !stopped {
			stopped = true
			cancel()
			if err := <-done; err != nil {
				b.Error(err)
			}
		}
	}
	b.Cleanup(stop)
	return stop
}

// benchCtx bounds what one run of a benchmark function waits for by the
// go test default timeout.
func benchCtx(b *testing.B) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	b.Cleanup(cancel)
	return ctx
}

// benchSpin waits, yielding, until cond holds; for setup only, on
// conditions nothing signals (calls entering the fake, goroutines ending).
func benchSpin(b *testing.B, what string, cond func() bool) {
	for deadline := time.Now().Add(time.Minute); !cond(); runtime.Gosched() {
		if time.Now().After(deadline) {
			b.Fatalf("waiting for %s: gave up after a minute", what)
		}
	}
}

// benchWaitsIn waits until the informer's exit waits, one per running task,
// are all in the daemon.
func benchWaitsIn(b *testing.B, f *fakecontainerd.Fake, n int) {
	benchSpin(b, "the exit waits", func() bool { return f.Calls(fakecontainerd.TasksWait) >= n })
}

// benchMem is the heap in use and the stacks after two collections (the
// second empties what sync.Pools kept through the first).
func benchMem() (heap, stack uint64) {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc, ms.StackInuse
}

// benchCPU is the process's CPU time so far, user and system: every
// goroutine's, the fake daemon's and the garbage collector's included.
func benchCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// benchPerOp reports ns/unit and cpu-ns/unit over the timed loop that began
// at cpu0: units of work (containers, events) per b.N op.
func benchPerOp(b *testing.B, cpu0 time.Duration, units int, unit string) {
	cpu := benchCPU(b) - cpu0
	b.StopTimer()
	total := float64(b.N) * float64(units)
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/total, "ns/"+unit)
	b.ReportMetric(float64(cpu.Nanoseconds())/total, "cpu-ns/"+unit)
}

// benchList is the informer's listing without the informer: ListStream
// and Tasks.List through the fake's gRPC, every message received; it
// returns how many containers and tasks came.
func benchList(ctx context.Context, conn grpc.ClientConnInterface) (containers, tasks int, err error) {
	ctx = metadata.AppendToOutgoingContext(ctx, "containerd-namespace", containerd.K8sNamespace)
	stream, err := containersapi.NewContainersClient(conn).ListStream(ctx, &containersapi.ListContainersRequest{})
	if err != nil {
		return 0, 0, err
	}
	for {
		if _, err := stream.Recv(); err == io.EOF {
			break
		} else if err != nil {
			return 0, 0, err
		}
		containers++
	}
	resp, err := tasksapi.NewTasksClient(conn).List(ctx, &tasksapi.ListTasksRequest{})
	return containers, len(resp.GetTasks()), err
}

// BenchmarkInformerMemoryPerContainer syncs a container informer on 10,000
// containers, each with a running task and eight pod labels, and reports
// the heap in use after GC per container; ns/op is the cold sync, from Run
// until every container is cached and its Added change delivered.
//
//   - bytes/container: with the informer running, less the heap before it
//     was made (the fake's records and a warm connection). It counts the
//     cache (Container, Task, the labels map and strings decoded from the
//     listing, the map entry), the informer's bookkeeping per container,
//     and the exit wait of each running task: both ends of its Tasks.Wait
//     call, the informer's client stream and the fake's server stream (the
//     daemon's, in production, not in the informer's process).
//   - cache-bytes/container: the same once Run has returned and the exit
//     waits have ended, with the informer kept: the cache and what the
//     informer keeps per container without a wait in flight.
//   - wait-bytes/container: the difference, what a wait in flight holds.
//   - stack-bytes/container and goroutines/container, while running:
//     goroutine stacks are not heap, and not in bytes/container.
//
// Not counted: garbage (the listing's messages, collected), sync.Pool
// contents (emptied by the second GC), and what an earlier informer on the
// same connection left for reuse: one unmeasured round runs first, so that
// the runtime's records of ended goroutines (480 B each, kept for new
// goroutines) and the transport's stream maps, which do not shrink, are in
// the baseline; a process that never had those goroutines pays for them
// too. EVENTMONITOR_BENCH_HEAPPROFILE=dir writes the heap profiles of the
// last round there (heap-running, heap-cached; run with -memprofilerate 1
// for exact ones).
func BenchmarkInformerMemoryPerContainer(b *testing.B) {
	const n = 10_000
	f := fakecontainerd.New(b)
	benchPopulate(f.Namespace(containerd.K8sNamespace), n)
	if _, _, err := benchList(benchCtx(b), f.Conn()); err != nil { // connect, and warm the transport
		b.Fatal(err)
	}
	b.StopTimer()
	benchMemRound(b, f, n) // the warm-up
	b.ResetTimer()
	var sum benchMemFigures
	for range b.N {
		m := benchMemRound(b, f, n)
		sum.running += m.running
		sum.cached += m.cached
		sum.stack += m.stack
		sum.goroutines += m.goroutines
	}
	runs := float64(b.N) * n
	b.ReportMetric(sum.running/runs, "bytes/container")
	b.ReportMetric(sum.cached/runs, "cache-bytes/container")
	b.ReportMetric((sum.running-sum.cached)/runs, "wait-bytes/container")
	b.ReportMetric(sum.stack/runs, "stack-bytes/container")
	b.ReportMetric(sum.goroutines/runs, "goroutines/container")
}

// benchMemFigures are one round's growths, in bytes and goroutines.
type benchMemFigures struct{ running, cached, stack, goroutines float64 }

// benchMemRound runs an informer on f's n containers until synced and
// measures it, then stops it and measures what it kept. Only the sync is
// timed.
func benchMemRound(b *testing.B, f *fakecontainerd.Fake, n int) benchMemFigures {
	heap0, stack0 := benchMem()
	g0, waits0 := runtime.NumGoroutine(), f.Calls(fakecontainerd.TasksWait)
	var delivered atomic.Int64
	b.StartTimer()
	inf, err := containerd.NewContainerInformer(f.Conn(), containerd.K8sNamespace,
		func(context.Context, containerd.Change[containerd.Container]) error {
			delivered.Add(1)
			return nil
		},
		containerd.WithLogger(benchQuiet()), containerd.WithRelistPeriod(0))
	if err != nil {
		b.Fatal(err)
	}
	stop := benchRun(b, inf)
	ctx := benchCtx(b)
	if err := inf.WaitForSync(ctx); err != nil {
		b.Fatal(err)
	}
	if err := inf.Monitor().WaitIdle(ctx); err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	if got := delivered.Load(); got != int64(n) || inf.Stats().Objects != n {
		b.Fatalf("%d changes delivered, %d cached: want %d", got, inf.Stats().Objects, n)
	}
	benchWaitsIn(b, f, waits0+n)
	heap1, stack1 := benchMem()
	g1 := runtime.NumGoroutine()
	benchHeapProfile(b, "heap-running")
	stop()
	benchSpin(b, "the informer's goroutines to end", func() bool { return runtime.NumGoroutine() <= g0 })
	heap2, _ := benchMem()
	benchHeapProfile(b, "heap-cached")
	if inf.Stats().Objects != n {
		b.Fatal("the cache went")
	}
	runtime.KeepAlive(inf)
	return benchMemFigures{
		running:    float64(int64(heap1) - int64(heap0)),
		cached:     float64(int64(heap2) - int64(heap0)),
		stack:      float64(int64(stack1) - int64(stack0)),
		goroutines: float64(g1 - g0),
	}
}

// benchHeapProfile writes the heap profile (as of the last GC) to name in
// $EVENTMONITOR_BENCH_HEAPPROFILE, if it is set.
func benchHeapProfile(b *testing.B, name string) {
	dir := os.Getenv("EVENTMONITOR_BENCH_HEAPPROFILE")
	if dir == "" {
		return
	}
	out, err := os.Create(filepath.Join(dir, name))
	if err == nil {
		err = pprof.WriteHeapProfile(out)
		if cerr := out.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		b.Fatal(err)
	}
}

// BenchmarkInformerRelist times one full relist of 1,000 and 10,000
// containers, each with a running task: the listing (ListStream and
// Tasks.List through the fake's gRPC), an observation per container
// submitted to the intake, each applied and diffed against the cache, and
// the changes found delivered to a no-op handler. unchanged: the daemon
// shows what the cache holds; 1%-changed: every relist finds 1% of the
// tasks paused, or resumed again, which the stream never said. A relist is
// started by stepping the informer's fake clock past WithRelistPeriod and
// waited for by the informer's "relist applied" log line. listing-only is
// the listing alone, without an informer: what the fake and gRPC cost.
// allocs/op are the whole process's, the fake's serving included.
func BenchmarkInformerRelist(b *testing.B) {
	for _, n := range []int{1_000, 10_000} {
		b.Run(fmt.Sprintf("containers=%d/listing-only", n), func(b *testing.B) {
			f := fakecontainerd.New(b)
			benchPopulate(f.Namespace(containerd.K8sNamespace), n)
			ctx := benchCtx(b)
			if _, _, err := benchList(ctx, f.Conn()); err != nil { // connect
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.ResetTimer()
			cpu0 := benchCPU(b)
			for range b.N {
				if cs, ts, err := benchList(ctx, f.Conn()); err != nil || cs != n || ts != n {
					b.Fatalf("listed %d containers and %d tasks (%v): want %d", cs, ts, err, n)
				}
			}
			benchPerOp(b, cpu0, n, "container")
		})
		for _, changed := range []int{0, n / 100} {
			name := "unchanged"
			if changed > 0 {
				name = "1%-changed"
			}
			b.Run(fmt.Sprintf("containers=%d/%s", n, name), func(b *testing.B) { benchRelist(b, n, changed) })
		}
	}
}

func benchRelist(b *testing.B, n, changed int) {
	const period = time.Minute
	clk := testclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	f := fakecontainerd.New(b, fakecontainerd.WithClock(clk))
	ns := f.Namespace(containerd.K8sNamespace)
	ids := benchPopulate(ns, n)
	// Two views, served in turn: all running, and every 100th paused. Made
	// before the informer runs, as any change wakes every Tasks.Wait.
	var views [2]*fakecontainerd.Snapshot
	if changed > 0 {
		views[0] = f.Snapshot()
		q := ns.Quiet()
		for i := 0; i < changed; i++ {
			q.PauseTask(ids[i*100])
		}
		views[1] = f.Snapshot()
		for i := 0; i < changed; i++ {
			q.ResumeTask(ids[i*100])
		}
	}
	relisted := make(benchRelisted, 1)
	var delivered atomic.Int64
	inf, err := containerd.NewContainerInformer(f.Conn(), containerd.K8sNamespace,
		func(context.Context, containerd.Change[containerd.Container]) error {
			delivered.Add(1)
			return nil
		},
		containerd.WithClock(clk), containerd.WithLogger(relisted.logger()), containerd.WithRelistPeriod(period))
	if err != nil {
		b.Fatal(err)
	}
	benchRun(b, inf)
	ctx := benchCtx(b)
	// The subscription is established at its first envelope, without
	// stepping the clock: one for no container.
	if err := f.WaitSubscribers(ctx, 1); err != nil {
		b.Fatal(err)
	}
	ns.Publish(&events.ContainerDelete{ID: "establish"})
	relisted.wait(b)
	if err := inf.Monitor().WaitIdle(ctx); err != nil {
		b.Fatal(err)
	}
	benchWaitsIn(b, f, n)
	if s := inf.Stats(); s.Objects != n || s.Relists != 1 {
		b.Fatalf("after the first relist: %+v, want %d objects", s, n)
	}
	delivered.Store(0)
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := benchCPU(b)
	for i := range b.N {
		if changed > 0 {
			f.ServeSnapshot(views[(i+1)%2])
		}
		clk.Step(period)
		relisted.wait(b)
		if err := inf.Monitor().WaitIdle(ctx); err != nil {
			b.Fatal(err)
		}
	}
	benchPerOp(b, cpu0, n, "container")
	f.ServeSnapshot(nil)
	s := inf.Stats()
	if s.Relists != uint64(1+b.N) || s.Objects != n || s.Corrections != uint64(b.N*changed) || delivered.Load() != int64(b.N*changed) {
		b.Fatalf("after %d relists: %+v, %d delivered; want %d corrections", b.N, s, delivered.Load(), b.N*changed)
	}
}

// benchFeed is a fake daemon with n running containers and a TaskPaused
// and a TaskResumed envelope for each, which run delivers in turn; count
// is the no-op handler's, for each event handled.
type benchFeed struct {
	f       *fakecontainerd.Fake
	n       int
	envs    [2][]*apitypes.Envelope // paused, resumed
	handled atomic.Int64
	want    atomic.Int64
	reached chan struct{}
}

func newBenchFeed(b *testing.B, n int) *benchFeed {
	f := fakecontainerd.New(b)
	ns := f.Namespace(containerd.K8sNamespace)
	ids := benchPopulate(ns, n)
	e := &benchFeed{f: f, n: n, reached: make(chan struct{}, 1)}
	q := ns.Quiet()
	for _, id := range ids {
		e.envs[0] = append(e.envs[0], q.PauseTask(id))
		e.envs[1] = append(e.envs[1], q.ResumeTask(id))
	}
	return e
}

func (e *benchFeed) count() {
	if e.handled.Add(1) == e.want.Load() {
		select {
		case e.reached <- struct{}{}:
		default:
		}
	}
}

// waitHandled waits until the handler has counted n events since run began.
func (e *benchFeed) waitHandled(b *testing.B, n int64) {
	e.want.Store(n)
	for e.handled.Load() < n {
		select {
		case <-e.reached:
		case <-time.After(time.Minute):
			b.Fatalf("%d of %d events handled in a minute", e.handled.Load(), n)
		}
	}
}

// run delivers b.N events, a batch of one event per container at a time,
// pausing them all then resuming them all, with two batches in flight (the
// fake holds 4,096 per subscriber), and waits until all are handled. It
// reports the wall time and the process's CPU time (user and system, every
// goroutine's: the fake's, gRPC's and the garbage collector's included)
// per event. Each envelope has a timestamp of its own, later than the one
// before.
func (e *benchFeed) run(b *testing.B) {
	if err := e.f.WaitSubscribers(benchCtx(b), 1); err != nil {
		b.Fatal(err)
	}
	e.handled.Store(0)
	base := time.Now()
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := benchCPU(b)
	for sent, batch := 0, 0; sent < b.N; batch++ {
		if batch >= 2 {
			e.waitHandled(b, int64((batch-1)*e.n))
		}
		envs := e.envs[batch%2][:min(e.n, b.N-sent)]
		for i, env := range envs {
			at := base.Add(time.Duration(sent + i))
			env.Timestamp.Seconds, env.Timestamp.Nanos = at.Unix(), int32(at.Nanosecond())
		}
		e.f.Deliver(envs...)
		sent += len(envs)
	}
	e.waitHandled(b, int64(b.N))
	benchPerOp(b, cpu0, 1, "event")
}

const benchPerEventContainers = 1_000

// BenchmarkInformerPerEvent streams TaskPaused and TaskResumed, in turn,
// for 1,000 running containers into a synced container informer, each
// event applied to the cache and its change delivered to a no-op handler.
// Every event is a change. Beside BenchmarkMonitorPerEvent (the same
// stream into a bare monitor) and BenchmarkBareSubscriberPerEvent (a gRPC
// loop alone, the fake's own cost): see benchFeed.run.
func BenchmarkInformerPerEvent(b *testing.B) {
	e := newBenchFeed(b, benchPerEventContainers)
	inf, err := containerd.NewContainerInformer(e.f.Conn(), containerd.K8sNamespace,
		func(context.Context, containerd.Change[containerd.Container]) error {
			e.count()
			return nil
		},
		containerd.WithLogger(benchQuiet()), containerd.WithRelistPeriod(0))
	if err != nil {
		b.Fatal(err)
	}
	benchRun(b, inf)
	ctx := benchCtx(b)
	if err := inf.WaitForSync(ctx); err != nil {
		b.Fatal(err)
	}
	if err := inf.Monitor().WaitIdle(ctx); err != nil {
		b.Fatal(err)
	}
	benchWaitsIn(b, e.f, e.n)
	e.run(b)
	if s := inf.Stats(); s.Objects != e.n || s.Relists != 1 || s.Refreshes != 0 {
		b.Fatalf("%+v: want %d objects, one relist, no refresh", s, e.n)
	}
}

// BenchmarkMonitorPerEvent is BenchmarkInformerPerEvent's stream into a
// bare eventmonitor.Monitor: Run on containerd.NewSubscriber with the
// informer's filters, containerd.Converter(), the default options (one
// worker, a 10 s deadline per call, as the informer's delivery has) and a
// no-op handler.
func BenchmarkMonitorPerEvent(b *testing.B) {
	e := newBenchFeed(b, benchPerEventContainers)
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(context.Context, any) error {
		e.count()
		return nil
	}), eventmonitor.WithConverter(containerd.Converter()), eventmonitor.WithNamespace(containerd.K8sNamespace),
		eventmonitor.WithLogger(benchQuiet()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(m.Stop)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx, containerd.NewSubscriber(e.f.Conn()), benchFilters(b)...) }()
	b.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			b.Error(err)
		}
	})
	e.run(b)
}

// BenchmarkBareSubscriberPerEvent reads BenchmarkInformerPerEvent's stream
// with a gRPC Events.Subscribe loop of one goroutine and the same filters:
// recv takes each envelope off the stream, recv+decode also decodes its
// event with typeurl, as a user's loop without a monitor does (the bench
// module's scenario 6). recv is the fake's and gRPC's share of the other
// two benchmarks' CPU per event.
func BenchmarkBareSubscriberPerEvent(b *testing.B) {
	for _, decode := range []bool{false, true} {
		name := "recv"
		if decode {
			name = "recv+decode"
		}
		b.Run(name, func(b *testing.B) {
			e := newBenchFeed(b, benchPerEventContainers)
			ctx, cancel := context.WithCancel(context.Background())
			stream, err := eventsapi.NewEventsClient(e.f.Conn()).Subscribe(ctx, &eventsapi.SubscribeRequest{Filters: benchFilters(b)})
			if err != nil {
				cancel()
				b.Fatal(err)
			}
			done := make(chan struct{})
			go func() {
				defer close(done)
				for {
					env, err := stream.Recv()
					if err != nil {
						return
					}
					if decode {
						if _, err := typeurl.UnmarshalAny(env.GetEvent()); err != nil {
							b.Error(err)
							return
						}
					}
					e.count()
				}
			}()
			b.Cleanup(func() {
				cancel()
				<-done
			})
			e.run(b)
		})
	}
}
