// Package containerd connects eventmonitor to containerd: a Subscriber over
// containerd's events service (NewSubscriber, or FromSubscribe for a plugin
// inside containerd), a Converter keying every event type of
// github.com/containerd/containerd/api/events, Filters that ask the daemon
// for only those types, WaitExit (a task's exit that a daemon restart does
// not fake), the builders WatchExit needs, and informers: a cached view of a
// namespace's containers or images that stays right across daemon restarts.
//
//	conn, err := containerd.Dial(ctx, "/run/containerd/containerd.sock")
//	...
//	inf, err := containerd.NewContainerInformer(conn, containerd.K8sNamespace,
//		func(ctx context.Context, c containerd.Change[containerd.Container]) error { ... })
//	go inf.Run(ctx)
//	err = inf.WaitForSync(ctx) // then inf.Get, inf.List
//
// It is a module of its own, so that the eventmonitor library does not
// depend on gRPC or containerd's API. It is tested against containerd 1.6
// (Debian's package) and 2.4 (built from the Go module proxy); package
// containerdtest starts such a daemon for tests.
//
// # What containerd does not guarantee
//
// The stream does not always deliver a task's events, nor in order: the
// shim publishes TaskCreate, TaskStart, TaskExit and TaskOOM through a
// queue of its own, the daemon TaskDelete, so under churn TaskDelete may
// come first, and either may never come (measured with 2.4). Around a
// daemon restart, 1.6 may publish a second TaskExit and TaskDelete with a
// made-up status (137 or 255), and a shim re-sends an exit up to 15 s late
// with its original timestamp; 2.4 drops, as it starts, every exited task
// not yet deleted, and publishes nothing for it. A new subscription
// registers a few tens of milliseconds after it is accepted.
//
// # How an informer stays right
//
// It subscribes, then lists (after every subscription, and every
// WithRelistPeriod), and applies events, listings, single reads (Resync)
// and exit waits to one object at a time. Each cached object carries when
// its newest news began (an event's timestamp, or when a listing or read
// began); older news is skipped, and a skipped listing reads the object
// again. A task's status only moves forward within its lifetime (created,
// running or paused, stopped), so every lifetime has one change to
// Stopped, whose exit status is the daemon's record: Tasks.Get when a
// TaskExit comes, TaskDelete's status, the listing's, or the task's exit
// wait's, and UnknownExitCode when the daemon lost it. A deleted object's
// last change carries its last state (for a container, LastExit: how its
// last task ended), kept only until delivered.
package containerd
