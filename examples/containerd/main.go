// Command containerd handles the events of a running containerd: it prints
// every event it handles with its key, and with -fail makes a fraction of
// handler calls fail, to show the per-key retries.
//
//	go run ./examples/containerd -address /run/containerd/containerd.sock -namespace k8s.io -fail 0.3
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

	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
)

// keyed carries the converter's key to the handler, so that it can print it.
type keyed struct {
	key   string
	event any
}

func main() {
	address := flag.String("address", "/run/containerd/containerd.sock", "containerd's gRPC socket")
	namespace := flag.String("namespace", containerd.K8sNamespace, `only events of this namespace; "" for all`)
	fail := flag.Float64("fail", 0, "fraction of handler calls that fail, to show retries")
	backoff := flag.Duration("backoff", time.Second, "initial retry delay (doubles up to 1 minute)")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *address, *namespace, *fail, *backoff); err != nil {
		fmt.Fprintln(os.Stderr, "containerd example:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, address, namespace string, fail float64, backoff time.Duration) error {
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
	m, err := eventmonitor.New(
		eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
			e := event.(keyed)
			if rand.Float64() < fail {
				return errors.New("simulated failure (-fail)")
			}
			fmt.Printf("%s  handled %-16s key=%s\n", time.Now().Format("15:04:05.000"),
				reflect.TypeOf(e.event).Elem().Name(), e.key)
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
