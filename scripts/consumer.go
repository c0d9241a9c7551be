//go:build ignore

// The README's tour as a program of a module outside this repository:
// scripts/modules.sh consumer builds it against the modules as released,
// with no replace directives and the user's own go directive.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"time"

	"github.com/containerd/containerd/api/events"
	"github.com/containerd/log"
	prometheusclient "github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
	emprom "github.com/eventmonitor/eventmonitor/prometheus"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := tour(ctx, "/run/containerd/containerd.sock"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func handleExit(ctx context.Context, e *events.TaskExit) error {
	log.G(ctx).WithField("status", e.ExitStatus).Info("container exited")
	return nil
}

func tour(ctx context.Context, address string) error {
	conn, err := containerd.Dial(ctx, address)
	if err != nil {
		return err
	}
	defer conn.Close()

	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(ctx context.Context, e *events.TaskExit) error {
		return handleExit(ctx, e) // an error, or a panic, backs the event off
	})
	keys := []eventmonitor.TypeKey{
		eventmonitor.KeyOf(func(e *events.TaskExit) string { return e.ContainerID }),
	}
	collector := emprom.New()
	m, err := eventmonitor.New(mux,
		eventmonitor.WithNamespace(containerd.K8sNamespace),
		eventmonitor.WithConverter(eventmonitor.NewConverter(keys...)),
		eventmonitor.WithWorkers(4),                          // 4 keys at once
		eventmonitor.WithBackoff(time.Second, 5*time.Minute), // containerd's defaults
		eventmonitor.WithMetrics(collector),
		eventmonitor.WithDropHandler(func(d eventmonitor.Drop) { // nothing is lost silently
			log.L.WithError(d.Reason).Warn(d)
		}),
	)
	if err != nil {
		return err
	}
	defer m.Shutdown(context.Background()) // drain, then stop: bounded by the handle timeout
	collector.Watch(m)
	prometheusclient.MustRegister(collector)

	filters, err := containerd.Filters(containerd.K8sNamespace, keys...) // only what we key crosses the socket
	if err != nil {
		return err
	}
	go watchContainers(ctx, conn)
	return m.Run(ctx, containerd.NewSubscriber(conn), filters...) // re-subscribes on stream errors
}

// watchContainers is the README's informer: a cached view of the
// namespace's containers, with a change per object.
func watchContainers(ctx context.Context, conn *grpc.ClientConn) {
	inf, err := containerd.NewContainerInformer(conn, containerd.K8sNamespace,
		func(ctx context.Context, ch containerd.Change[containerd.Container]) error {
			if task, exited := containerd.Exited(ch); exited {
				log.G(ctx).WithField("status", task.ExitStatus).Info("task exited")
			}
			return nil
		})
	if err != nil {
		log.L.WithError(err).Error("informer")
		return
	}
	go inf.Run(ctx)
	if err := inf.WaitForSync(ctx); err == nil {
		log.L.WithField("containers", len(inf.List())).Info("synced")
	}
}
