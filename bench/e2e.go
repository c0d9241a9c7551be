package main

// Scenario 6: events out of a real containerd, end to end. The parent starts
// a private containerd (containerdtest.New) and publishes TaskExit events
// into it as fast as it takes them; a subscriber process of its own (this
// binary again, so that its CPU time is its own) reads them either with a
// bare gRPC subscription loop that decodes each with typeurl and calls a
// no-op, or with eventmonitor through containerd.NewSubscriber and the
// containerd converter. Each event carries its publish time, so the
// subscriber measures publish-to-handler latency.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/containerd/containerd/api/events"
	eventsapi "github.com/containerd/containerd/api/services/events/v1"
	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
	"github.com/eventmonitor/eventmonitor/containerd/containerdtest"
)

// The subscriber variants.
const (
	bareLoop           = "bare gRPC loop (a)"
	monitorDefault     = "eventmonitor (b)"
	monitorNoDeadlines = "eventmonitor, no deadline (b')"
)

var subscriberVariants = []string{bareLoop, monitorDefault, monitorNoDeadlines}

const (
	probeTopic    = "/eventmonitor-bench/probe"
	e2ePublishers = 4
)

// e2eResult is what a subscriber process reports.
type e2eResult struct {
	Rate        float64       // events/s, first to last event
	P50, P99    time.Duration // publish to handler
	CPUPerEvent time.Duration // the subscriber process's user and system time
}

// e2eSubscriberFlags are the flags of the subscriber process (hidden: the
// parent passes them).
var (
	e2eVariant = flag.String("e2e-subscriber", "", "run as the end-to-end scenario's subscriber of this variant")
	e2eSocket  = flag.String("e2e-socket", "", "the subscriber's containerd socket")
	e2eEvents  = flag.Int("e2e-events", 0, "how many TaskExit events the subscriber waits for")
	e2eProfile = flag.String("e2e-profile", "", "the subscriber's CPU profile, from its first event to its last")
)

// e2eProfiles, if set, is where each variant's subscriber writes its CPU
// profile under the flood, as <variant>.pprof: the last run's.
var e2eProfiles = flag.String("e2e-cpuprofile", "", "end to end: a directory for each subscriber's CPU profile under the flood")

// pacedRate and pacedEvents make the scenario's second pass: latency below
// saturation, where it is the subscriber's own and not the daemon's queue.
const (
	pacedRate   = 2000
	pacedEvents = 4000
)

// e2eTable runs every variant runs times, interleaved, over n events each
// published as fast as the daemon takes them, and again paced, and prints
// the medians side by side; or says why it cannot.
func e2eTable(n, runs int) {
	fmt.Println("\n6. end to end through a real containerd (TaskExit events)")
	d, err := containerdtest.New()
	if errors.Is(err, containerdtest.ErrUnavailable) {
		fmt.Println("   skipped:", err)
		return
	}
	if err != nil {
		fmt.Println("   failed to start containerd:", err)
		os.Exit(1)
	}
	defer d.Remove()
	version, err := d.Version()
	if err != nil {
		version = "(version unknown)"
	}
	fmt.Printf("   containerd %s\n", version)

	flood, paced := map[string][]e2eResult{}, map[string][]e2eResult{}
	for range max(1, runs) {
		for _, v := range subscriberVariants {
			for _, pass := range []struct {
				results map[string][]e2eResult
				n, rate int
			}{{flood, n, 0}, {paced, pacedEvents, pacedRate}} {
				r, err := e2eRun(d.Address(), v, pass.n, pass.rate)
				if err != nil {
					fmt.Fprintf(os.Stderr, "bench: end to end, %s: %v\n", v, err)
					d.Remove()
					os.Exit(1)
				}
				pass.results[v] = append(pass.results[v], r)
			}
		}
	}
	median := func(results map[string][]e2eResult) func(v string, f func(e2eResult) float64) float64 {
		return func(v string, f func(e2eResult) float64) float64 {
			xs := make([]float64, 0, len(results[v]))
			for _, r := range results[v] {
				xs = append(xs, f(r))
			}
			slices.Sort(xs)
			return xs[len(xs)/2]
		}
	}
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(w, "   measure\t%s\t%s\t%s\t(b) against (a)\t(b') against (a)\n", bareLoop, monitorDefault, monitorNoDeadlines)
	flooded := fmt.Sprintf("flood of %d", n)
	pacedAt := fmt.Sprintf("%d at %d/s", pacedEvents, pacedRate)
	for _, m := range []struct {
		name    string
		results map[string][]e2eResult
		f       func(e2eResult) float64
		format  func(float64) string
		diff    bool // compare by difference, not ratio
	}{
		{flooded + ": events/s", flood, func(r e2eResult) float64 { return r.Rate }, func(v float64) string { return fmt.Sprintf("%.0f", v) }, false},
		{flooded + ": latency p50", flood, func(r e2eResult) float64 { return r.P50.Seconds() }, fmtSeconds, true},
		{flooded + ": latency p99", flood, func(r e2eResult) float64 { return r.P99.Seconds() }, fmtSeconds, true},
		{flooded + ": CPU/event", flood, func(r e2eResult) float64 { return r.CPUPerEvent.Seconds() }, fmtSeconds, false},
		{pacedAt + ": latency p50", paced, func(r e2eResult) float64 { return r.P50.Seconds() }, fmtSeconds, true},
		{pacedAt + ": latency p99", paced, func(r e2eResult) float64 { return r.P99.Seconds() }, fmtSeconds, true},
		{pacedAt + ": CPU/event", paced, func(r e2eResult) float64 { return r.CPUPerEvent.Seconds() }, fmtSeconds, false},
	} {
		median := median(m.results)
		a, b, b2 := median(bareLoop, m.f), median(monitorDefault, m.f), median(monitorNoDeadlines, m.f)
		against := func(x float64) string {
			if m.diff {
				return fmt.Sprintf("%+.1fµs", (x-a)*1e6)
			}
			return fmt.Sprintf("%.2f×", x/a)
		}
		fmt.Fprintf(w, "   %s\t%s\t%s\t%s\t%s\t%s\n", m.name, m.format(a), m.format(b), m.format(b2), against(b), against(b2))
	}
	w.Flush()
	fmt.Printf("   medians of %d runs; latency from publish to handler; CPU is the subscriber process's own, user and system\n", runs)
}

// e2eRun starts a subscriber process of variant, waits until its
// subscription is live, publishes n events, rate a second or (0) as fast as
// the daemon takes them, and returns what the subscriber measured.
func e2eRun(socket, variant string, n, rate int) (e2eResult, error) {
	self, err := os.Executable()
	if err != nil {
		return e2eResult{}, err
	}
	args := []string{"-e2e-subscriber", variant, "-e2e-socket", socket, "-e2e-events", fmt.Sprint(n)}
	if *e2eProfiles != "" && rate == 0 {
		name := strings.Map(func(r rune) rune {
			if strings.ContainsRune(" (),'", r) {
				return '_'
			}
			return r
		}, variant)
		args = append(args, "-e2e-profile", filepath.Join(*e2eProfiles, name+".pprof"))
	}
	cmd := exec.Command(self, args...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return e2eResult{}, err
	}
	if err := cmd.Start(); err != nil {
		return e2eResult{}, err
	}
	defer cmd.Wait()
	defer cmd.Process.Kill() // if anything below fails

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	conn, err := containerd.Dial(ctx, socket)
	if err != nil {
		return e2eResult{}, err
	}
	defer conn.Close()
	client := eventsapi.NewEventsClient(conn)
	publish := func(topic string, event any) error {
		payload, err := typeurl.MarshalAnyToProto(event)
		if err != nil {
			return err
		}
		ctx := metadata.AppendToOutgoingContext(ctx, "containerd-namespace", containerd.K8sNamespace)
		_, err = client.Publish(ctx, &eventsapi.PublishRequest{Topic: topic, Event: payload})
		return err
	}

	// containerd registers a subscriber some time after Subscribe returns:
	// probe until the subscriber says it saw one.
	ready := make(chan error, 1)
	lines := make(chan string, 2)
	go func() {
		defer close(lines)
		scanner := bufio.NewScanner(out)
		for scanner.Scan() {
			lines <- scanner.Text()
		}
		if err := scanner.Err(); err != nil {
			ready <- err
		}
	}()
	for probing := true; probing; {
		if err := publish(probeTopic, &events.NamespaceUpdate{Name: "probe"}); err != nil {
			return e2eResult{}, err
		}
		select {
		case line := <-lines:
			if line != "ready" {
				return e2eResult{}, fmt.Errorf("subscriber said %q before ready", line)
			}
			probing = false
		case err := <-ready:
			return e2eResult{}, err
		case <-time.After(20 * time.Millisecond): // the probe's period
		}
	}

	publishers, start := e2ePublishers, time.Now()
	if rate > 0 {
		publishers = 1 // one paced publisher
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, publishers)
	for range publishers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1); i <= int64(n); i = next.Add(1) {
				if rate > 0 {
					time.Sleep(time.Until(start.Add(time.Duration(i) * time.Second / time.Duration(rate)))) // pacing
				}
				exit := &events.TaskExit{ContainerID: fmt.Sprintf("c%04d", i%1000), ID: "init", ExitStatus: 0,
					ExitedAt: timestamppb.Now()} // the publish time, for the latency
				if err := publish("/tasks/exit", exit); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return e2eResult{}, err
	}
	line, ok := <-lines
	if !ok {
		return e2eResult{}, errors.New("the subscriber ended without a result")
	}
	var r e2eResult
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		return e2eResult{}, fmt.Errorf("subscriber result %q: %w", line, err)
	}
	return r, nil
}

// e2eSubscriber is the subscriber process: it subscribes as variant, says
// "ready" once it sees a probe, handles n TaskExit events and prints what it
// measured as JSON.
func e2eSubscriber(variant, socket string, n int) error {
	log.L.Logger.SetLevel(log.ErrorLevel)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	conn, err := containerd.Dial(ctx, socket)
	if err != nil {
		return err
	}
	defer conn.Close()

	startProfile := func() {}
	if *e2eProfile != "" {
		f, err := os.Create(*e2eProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		startProfile = func() {
			if err := pprof.StartCPUProfile(f); err != nil {
				fmt.Fprintln(os.Stderr, "bench: profile:", err)
			}
		}
	}
	var probed sync.Once
	latencies := make([]time.Duration, 0, n)
	var first time.Time
	var firstCPU time.Duration
	done := make(chan e2eResult, 1)
	// handle is the no-op each variant calls, after recording the event.
	handle := func(event any) {
		switch e := event.(type) {
		case *events.NamespaceUpdate:
			probed.Do(func() { fmt.Println("ready") })
		case *events.TaskExit:
			now := time.Now()
			if len(latencies) == 0 {
				first, firstCPU = now, processCPU()
				startProfile()
			}
			latencies = append(latencies, now.Sub(e.ExitedAt.AsTime()))
			if len(latencies) == n {
				cpu := processCPU() - firstCPU
				pprof.StopCPUProfile()
				slices.Sort(latencies)
				done <- e2eResult{
					Rate:        float64(n-1) / now.Sub(first).Seconds(),
					P50:         latencies[n/2],
					P99:         latencies[n*99/100],
					CPUPerEvent: cpu / time.Duration(n),
				}
			}
		}
	}

	switch variant {
	case bareLoop:
		go bareSubscription(ctx, conn, handle)
	case monitorDefault, monitorNoDeadlines:
		opts := []eventmonitor.Option{eventmonitor.WithConverter(containerd.Converter())}
		if variant == monitorNoDeadlines {
			opts = append(opts, eventmonitor.WithHandleTimeout(0))
		}
		m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(_ context.Context, event any) error {
			handle(event)
			return nil
		}), opts...)
		if err != nil {
			return err
		}
		defer m.Stop()
		go m.Run(ctx, containerd.NewSubscriber(conn))
	default:
		return fmt.Errorf("unknown variant %q", variant)
	}
	select {
	case r := <-done:
		out, err := json.Marshal(r)
		if err != nil {
			return err
		}
		fmt.Println(string(out))
		return nil
	case <-time.After(2 * time.Minute):
		return fmt.Errorf("handled %d of %d events in 2 minutes", len(latencies), n)
	}
}

// bareSubscription is what a user writes without a monitor: subscribe,
// receive, decode with typeurl, handle.
func bareSubscription(ctx context.Context, conn grpc.ClientConnInterface, handle func(any)) {
	stream, err := eventsapi.NewEventsClient(conn).Subscribe(ctx, &eventsapi.SubscribeRequest{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench: subscribe:", err)
		os.Exit(1)
	}
	for {
		env, err := stream.Recv()
		if err != nil {
			return
		}
		event, err := typeurl.UnmarshalAny(env.GetEvent())
		if err != nil {
			continue
		}
		handle(event)
	}
}
