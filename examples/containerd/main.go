// Command containerd handles the events of a running containerd: it prints
// every event it handles with its key, and with -fail makes a fraction of
// handler calls fail, to show the per-key retries. With -exits, it also
// waits for the exit of every task it sees start, with WaitExit, which a
// daemon restart does not turn into an exit, and handles it as a TaskExit
// of the task's key.
//
//	go run ./examples/containerd -address /run/containerd/containerd.sock -namespace k8s.io -fail 0.3 -exits
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"reflect"
	"syscall"
	"time"

	"github.com/containerd/containerd/api/events"
	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/grpc"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
)

// keyed carries the converter's key to the handler, so that it can print it,
// and where the event came from.
type keyed struct {
	key   string
	event any
	via   string // "" for the stream
}

func main() {
	address := flag.String("address", "/run/containerd/containerd.sock", "containerd's gRPC socket")
	namespace := flag.String("namespace", containerd.K8sNamespace, `only events of this namespace; "" for all`)
	fail := flag.Float64("fail", 0, "fraction of handler calls that fail, to show retries")
	backoff := flag.Duration("backoff", time.Second, "initial retry delay (doubles up to 1 minute)")
	exits := flag.Bool("exits", false, "wait for the exit of every task seen starting (needs -namespace)")
	flag.Parse()
	if *exits && *namespace == "" {
		fmt.Fprintln(os.Stderr, "containerd example: -exits needs -namespace (a task is waited on in its namespace)")
		os.Exit(2)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *address, *namespace, *fail, *backoff, *exits); err != nil {
		fmt.Fprintln(os.Stderr, "containerd example:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, address, namespace string, fail float64, backoff time.Duration, exits bool) error {
	dialCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := containerd.Dial(dialCtx, address)
	if err != nil {
		return err
	}
	defer conn.Close()

	// Retries and re-subscriptions are logged at info and warn level.
	log.L.Logger.SetLevel(log.InfoLevel)
	converter := containerd.Converter()
	var m *eventmonitor.Monitor // the handler starts exit waits on it
	m, err = eventmonitor.New(
		eventmonitor.HandlerFunc(func(_ context.Context, event any) error {
			e := event.(keyed)
			if rand.Float64() < fail {
				return errors.New("simulated failure (-fail)")
			}
			status := ""
			if exit, ok := e.event.(*events.TaskExit); ok {
				status = fmt.Sprintf(" status=%d", exit.ExitStatus)
			}
			fmt.Printf("%s  handled %-16s key=%s%s%s\n", time.Now().Format("15:04:05.000"),
				reflect.TypeOf(e.event).Elem().Name(), e.key, status, e.via)
			// Past -fail's failure, a TaskStart is handled once: one wait per task.
			if start, ok := e.event.(*events.TaskStart); ok && exits {
				watchExit(ctx, m, conn, namespace, e.key, start)
			}
			return nil
		}),
		eventmonitor.WithNamespace(namespace),
		eventmonitor.WithConverter(eventmonitor.ConverterFunc(func(payload typeurl.Any) (string, any, error) {
			key, event, err := converter.Convert(payload)
			return key, keyed{key: key, event: event}, err
		})),
		eventmonitor.WithWorkers(4),
		eventmonitor.WithBackoff(backoff, time.Minute),
	)
	if err != nil {
		return err
	}
	fmt.Printf("handling events of %s (namespace %q); Ctrl-C to stop\n", address, namespace)
	runErr := m.Run(ctx, containerd.NewSubscriber(conn))
	shutdownCtx, cancelShutdown := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancelShutdown()
	err = errors.Join(runErr, m.Shutdown(shutdownCtx))
	s := m.Stats()
	fmt.Printf("handled %d, failed %d calls, %d retries, %d filtered, %d ignored, %d dropped\n",
		s.Handled, s.Failed, s.Retried, s.Filtered, s.Ignored, s.Dropped)
	return err
}

// watchExit waits for the exit of the task that start reports, through the
// Tasks service, and hands it to m as a TaskExit of key, saying where it
// came from (an unreadable status arrives as eventmonitor.UnknownExitCode).
func watchExit(ctx context.Context, m *eventmonitor.Monitor, conn grpc.ClientConnInterface, namespace, key string, start *events.TaskStart) {
	build := containerd.TaskExit(start.ContainerID, start.ContainerID, start.Pid)
	eventmonitor.WatchExit(ctx, m, key, containerd.WaitExit(ctx, conn, namespace, start.ContainerID, ""),
		func(code uint32, exitedAt time.Time) any {
			return keyed{key: key, event: build(code, exitedAt), via: " (from WaitExit)"}
		})
}
