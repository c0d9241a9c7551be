package containerd_test

import (
	"context"
	"fmt"
	"log"
	"net/http"

	"github.com/eventmonitor/eventmonitor/containerd"
)

// Start the informer, wait for its first listing, read the cache, and react
// to changes as they come.
func ExampleNewContainerInformer() {
	ctx := context.Background()
	conn, err := containerd.Dial(ctx, "/run/containerd/containerd.sock")
	if err != nil {
		log.Fatal(err) // no socket, not a socket, or nobody listening: said at once
	}
	defer conn.Close()

	inf, err := containerd.NewContainerInformer(conn, containerd.K8sNamespace,
		func(ctx context.Context, ch containerd.Change[containerd.Container]) error {
			switch {
			case ch.Old == nil:
				fmt.Println("added", ch.New.ID)
			case ch.New == nil:
				// The tombstone: LastExit says how its task ended, or Task
				// if the container went before its task (or a relist found
				// both gone).
				end := ch.Old.Task
				if end == nil {
					end = ch.Old.LastExit
				}
				if end != nil {
					fmt.Println("deleted", ch.Old.ID, "exit", end.ExitStatus)
				}
			case ch.New.Task != nil && ch.New.Task.Status == containerd.TaskStopped &&
				(ch.Old.Task == nil || ch.Old.Task.Status != containerd.TaskStopped):
				// Once per task lifetime, with the daemon's record of the status.
				fmt.Println("exited", ch.New.ID, ch.New.Task.ExitStatus, "oom:", ch.New.Task.OOMKilled)
			}
			return nil // an error delivers the same change again, with backoff
		})
	if err != nil {
		log.Fatal(err)
	}
	go inf.Run(ctx) // until ctx ends, re-subscribing and relisting after every outage

	if err := inf.WaitForSync(ctx); err != nil {
		log.Fatal(err)
	}
	for _, c := range inf.List() { // sorted by ID; read-only
		if c.Task != nil {
			fmt.Println(c.ID, c.Task.Status, c.Task.Pid)
		}
	}
	if c, ok := inf.Get("my-container"); ok {
		fmt.Println(c.Image, c.Labels)
	}
}

// An image informer keys images by name: a tag is an added image, and a
// deleted one's tombstone still has the digest it pointed at.
func ExampleNewImageInformer() {
	ctx := context.Background()
	conn, err := containerd.Dial(ctx, "/run/containerd/containerd.sock")
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()

	images, err := containerd.NewImageInformer(conn, containerd.K8sNamespace,
		func(ctx context.Context, ch containerd.Change[containerd.Image]) error {
			switch {
			case ch.Old == nil:
				fmt.Println("pulled or tagged", ch.New.Name, ch.New.Target)
			case ch.New == nil:
				fmt.Println("removed", ch.Old.Name, "was", ch.Old.Target)
			case ch.Old.Target != ch.New.Target:
				fmt.Println("retagged", ch.New.Name, ch.Old.Target, "->", ch.New.Target)
			}
			return nil
		}, containerd.WithRelistPeriod(0)) // no periodic relist: only after each (re)subscription
	if err != nil {
		log.Fatal(err)
	}
	go images.Run(ctx)
	if err := images.WaitForSync(ctx); err != nil {
		log.Fatal(err)
	}
	if im, ok := images.Get("docker.io/library/busybox:latest"); ok {
		fmt.Println("busybox is", im.Target)
	}
}

// Resync reads one object again now, rather than at the next relist, when
// something outside the event stream says it changed; calls made before the
// read begins share it.
func ExampleInformer_Resync() {
	ctx := context.Background()
	conn, err := containerd.Dial(ctx, "/run/containerd/containerd.sock")
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	inf, err := containerd.NewContainerInformer(conn, containerd.K8sNamespace,
		func(context.Context, containerd.Change[containerd.Container]) error { return nil })
	if err != nil {
		log.Fatal(err)
	}
	go inf.Run(ctx)

	// For example, an operator's "this container looks wrong" button: what the
	// read finds, if it differs from the cache, reaches the handler as a change.
	http.HandleFunc("/resync", func(w http.ResponseWriter, r *http.Request) {
		inf.Resync(r.FormValue("id"))
		w.WriteHeader(http.StatusAccepted)
	})
	log.Fatal(http.ListenAndServe("localhost:8080", nil))
}

// A handler tells the three kinds of change apart by which side is nil.
func ExampleChange() {
	running := &containerd.Container{ID: "web", Task: &containerd.Task{Pid: 42, Status: containerd.TaskRunning}}
	stopped := &containerd.Container{ID: "web", Task: &containerd.Task{Pid: 42, Status: containerd.TaskStopped,
		ExitStatus: 137, OOMKilled: true}}
	tombstone := &containerd.Container{ID: "web", LastExit: stopped.Task} // its task deleted, then itself

	for _, ch := range []containerd.Change[containerd.Container]{
		{New: running}, {Old: running, New: stopped}, {Old: tombstone},
	} {
		switch {
		case ch.Old == nil:
			fmt.Println("added", ch.New.ID, ch.New.Task.Status)
		case ch.New == nil:
			end := ch.Old.Task // still set if the container went before its task
			if end == nil {
				end = ch.Old.LastExit
			}
			fmt.Println("deleted", ch.Old.ID, "exit", end.ExitStatus)
		default:
			fmt.Println("updated", ch.New.ID, ch.Old.Task.Status, "->", ch.New.Task.Status,
				"oom:", ch.New.Task.OOMKilled)
		}
	}
	// Output:
	// added web running
	// updated web running -> stopped oom: true
	// deleted web exit 137
}
