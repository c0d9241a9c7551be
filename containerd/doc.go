// Package containerd connects an eventmonitor.Monitor to containerd: a
// Subscriber over containerd's events gRPC service (NewSubscriber), or over
// the Subscribe method of containerd's client, the in-process one of a
// plugin inside containerd included (FromSubscribe); a Converter that keys
// every event type of github.com/containerd/containerd/api/events; Filters
// that ask the daemon for only the types a converter keys; WaitExit, a
// task's exit read through containerd's Tasks service, which a daemon
// restart does not turn into an exit; and the builders WatchExit needs to
// turn an exit status into a TaskExit or a SandboxExit.
//
//	conn, err := containerd.Dial(ctx, "/run/containerd/containerd.sock")
//	...
//	m, err := eventmonitor.New(handler,
//		eventmonitor.WithNamespace(containerd.K8sNamespace),
//		eventmonitor.WithConverter(containerd.Converter()))
//	...
//	err = m.Run(ctx, containerd.NewSubscriber(conn))
//
// It is a module of its own, so that the eventmonitor library does not
// depend on gRPC or containerd's API. It is tested against containerd 1.6
// (Debian's package) and 2.4 (built from the Go module proxy).
//
// # What containerd does not guarantee
//
// The monitor keeps the order in which the stream delivers a key's events,
// but containerd does not deliver a task's events in the order they
// happened, nor always all of them. The shim publishes TaskCreate,
// TaskStart, TaskExit (and the exec and OOM events) through its own queue,
// which forwards them to the daemon in order; the daemon publishes
// TaskDelete itself, when a client deletes the task. A client that deletes
// as soon as its Wait returns (ctr run --rm, the CRI plugin) races the
// shim's queue, and, measured here under load with containerd 2.4.2 (about
// 120 runs of one container): TaskDelete arrived before TaskExit 3 times;
// TaskExit never arrived 6 times (the shim was gone before its queue
// forwarded it); TaskDelete never arrived 6 times (the delete raced the
// shim's exit and ended in the daemon's dead-shim cleanup, which publishes
// nothing for a task already removed). containerd 1.6 delivered both, in
// order, in 40 runs, but its code has the same race. A dead shim also makes
// the daemon publish a TaskExit (status 255) and a TaskDelete of its own,
// which may repeat ones already sent.
//
// So a handler must treat TaskExit and TaskDelete each as possibly the
// first, the last or the only word on a task's end, and tolerate repeats.
// For the exit status itself, do what the CRI plugin does: wait on the
// task and hand the channel to eventmonitor.WatchExit with TaskExit's
// builder, and relist (the relist package) to catch what the stream never
// says. Outside containerd, wait with WaitExit rather than the client's
// task.Wait, whose channel reports a lost connection as an exit.
package containerd
