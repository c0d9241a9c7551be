package containerd_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/api/events"
	containersapi "github.com/containerd/containerd/api/services/containers/v1"
	eventsapi "github.com/containerd/containerd/api/services/events/v1"
	imagesapi "github.com/containerd/containerd/api/services/images/v1"
	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
	"github.com/eventmonitor/eventmonitor/containerd/containerdtest"
	"github.com/eventmonitor/eventmonitor/containerd/internal/fakecontainerd"
)

// The churn's namespace, images and sizes.
const (
	churnNS       = "emchurn"
	churnImage    = "docker.io/library/emchurn:1"
	churnImageTwo = "docker.io/library/emchurn-two:1"
	churnOutage   = 3 * time.Second // how long the daemon stays down
	churnRunners  = 4               // ctr run at once, as a kubelet's pod workers would
	churnQuick    = 84              // short-lived containers
	churnKillAt   = 50              // of them started when the daemon is killed
	churnOOMLimit = "33554432"
)

// TestInformerAgreesWithTheDaemonThroughChurnAndRestart is the informer's
// acceptance test, on a real daemon (containerd 1.6 or 2.x, whichever is
// first on PATH: CI runs it under both). A container informer and an image
// informer watch namespace emchurn while over a hundred real containers
// churn through it, kubelet-like (run detached, wait for the task, delete
// the task, then the container; exits of 0, of other codes and OOM kills;
// some left stopped; some long-running, released later), with images
// imported, tagged, labelled and removed, and the daemon is SIGKILLed in the
// middle of it:
//
//   - before the kill: the churn, with long-running containers up;
//   - the outage: one group of containers exits while the daemon is down
//     (their processes end; containerd 2.4.2 forgets such tasks at restart,
//     1.6 keeps their status); the daemon stays down churnOutage;
//   - right after the restart, while the informers are still without a
//     subscription, containers are created (with and without a task) and
//     deleted, and images tagged and removed: only a relist can see those.
//     So that this window is there on every run, the informers' Subscribe
//     calls are refused (codes.Unavailable, as a daemon still down would)
//     until its work is done, and the gate opens right after one of their
//     refused attempts: the worst phase the daemon can come back in, so the
//     time to be up to date is the worst case, measured every run. Their
//     other calls (the relist, exit waits) pass;
//   - then the time from the gate opening (and from the daemon serving) to
//     each informer's relist being applied and its cache equal to the
//     daemon's listing, asserted under 1 s;
//   - then the rest of the churn, and at the end, once quiet, the caches
//     equal the daemon's own listings (containers with their task: image,
//     labels, runtime, creation, task presence, pid, status, exit status and
//     time; images: name, target, labels, update time): 0 differences.
//
// Every task lifetime (container ID and pid) must have had exactly one
// change into Stopped, with the status it really exited with (what the test
// program was told to exit with, 137 for an OOM kill), or
// eventmonitor.UnknownExitCode where nobody can know it any more: the
// daemon had lost the task at the restart (2.4.2), or the test deleted it
// while the informer could not see (the window above). A raw subscription
// of the test's own records what the stream alone said of each lifetime,
// and the test reports how many exits only the informer's use of the
// daemon's record (its listing, its reads, its exit waits) got right. An
// OOM kill whose TaskOOM reached the informer while it was subscribed, before
// the task's deletion, must leave the task marked OOMKilled.
func TestInformerAgreesWithTheDaemonThroughChurnAndRestart(t *testing.T) {
	began := time.Now()
	d := containerdtest.Start(t, containerdtest.Isolated())
	version, err := d.Version()
	require.NoError(t, err)
	rootfs, err := d.Rootfs()
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	t.Cleanup(cancel)
	e := newChurnEnv(t, ctx, d)
	require.NoError(t, d.ImportImage(churnNS, churnImage))

	t.Cleanup(e.raw.start(ctx, e.rawConn))
	e.probe("the raw subscription")
	// Before the informers start: a container whose exit only the first
	// listing can tell.
	pre := e.add(churnLife{id: "pre-3", group: "pre", proc: containerdtest.Process{ExitCode: 3}, keep: true})
	require.NoError(t, e.start(pre))
	e.waitStopped("pre-3")
	pre.preRun = true
	go e.live(pre)
	ci, ii := e.startInformers()
	listening := time.Now() // the container informer's subscription is live

	// The churn's plan: long-running containers first, then the short ones.
	var longs []*churnLife
	for g, codes := range map[string][]uint32{"before": {40, 41, 42, 43}, "during": {20, 21, 22, 23, 24, 25}, "after": {30, 31, 32, 33, 34, 35}} {
		for i, code := range codes {
			longs = append(longs, e.add(churnLife{id: fmt.Sprintf("%s-%d", g, i), group: g,
				proc: containerdtest.Process{ExitCode: int(code), Release: g}}))
		}
	}
	slices.SortFunc(longs, func(a, b *churnLife) int { return strings.Compare(a.id, b.id) })
	quick := e.plan(churnQuick)
	for _, l := range longs {
		go e.live(l)
	}
	e.until("the long-running containers to run", 60*time.Second, func() bool { return e.started(longs...) == len(longs) })
	for _, l := range quick {
		go e.live(l)
	}

	// Images, while the churn runs.
	e.image("tag", churnImage, "docker.io/library/emchurn:2")
	e.image("tag", churnImage, "docker.io/library/emchurn:3")
	e.image("label", "docker.io/library/emchurn:2", "phase=before")
	e.image("rm", "docker.io/library/emchurn:3")
	e.until("half the churn to start", 60*time.Second, func() bool { return e.started(quick...) >= churnKillAt/2 })
	require.NoError(t, d.Release("before"))
	kept := slices.DeleteFunc(slices.Clone(quick), func(l *churnLife) bool { return !l.keep })
	e.until("the churn to reach the kill", 90*time.Second, func() bool {
		return e.started(quick...) >= churnKillAt && e.finished(kept[0]) && e.finished(e.lives["before-0"])
	})

	// The kill: no container is being created (a task creation cut by the
	// kill leaves a shim the restarted 2.4.2 does not know, which only the
	// cleanup can kill). The churn's waits and deletes go on into it, those
	// in flight cut, and from it on wait until the informers are up to
	// date after the restart.
	e.runs.pauseAndDrain()
	for _, g := range e.gates {
		g.hold()
	}
	relists := map[string]uint64{"containers": ci.Stats().Relists, "images": ii.Stats().Relists}
	running := e.running(longs)
	t.Logf("containerd %s: killing the daemon with %d long-running containers running, %d of %d short ones started",
		version, len(running), e.started(quick...), len(quick))
	d.Kill()
	killedAt := time.Now()
	e.ops.pause()
	require.NoError(t, d.Release("during"))
	for _, l := range longs {
		if l.group == "during" {
			e.until(l.id+"'s process to end in the outage", 20*time.Second, func() bool { return !churnAlive(l.pid) })
		}
	}
	select { // the rest of the outage
	case <-ctx.Done():
		t.Fatal(ctx.Err())
	case <-time.After(time.Until(killedAt.Add(churnOutage))):
	}
	require.NoError(t, d.Restart())
	servedAt := time.Now()
	e.probe("the raw subscription after the restart")
	atRestart, _, err := e.view()
	require.NoError(t, err)

	// Before the informers re-subscribe: containers created, with and
	// without a task, and deleted; images tagged and removed.
	var post []*churnLife
	for _, l := range []churnLife{
		{id: "post-0", group: "post", proc: containerdtest.Process{ExitCode: 0}},
		{id: "post-5", group: "post", proc: containerdtest.Process{ExitCode: 5}},
		{id: "post-long", group: "post", proc: containerdtest.Process{ExitCode: 50, Release: "post"}},
	} {
		p := e.add(l)
		require.NoError(t, e.start(p))
		post = append(post, p)
	}
	e.waitStopped("post-0")
	e.waitStopped("post-5")
	_, err = d.Ctr("-n", churnNS, "containers", "create", "--label", "group=notask", "--rootfs", rootfs, "post-notask", "/testprog", "0")
	require.NoError(t, err)
	deletedUnseen := map[string]bool{}
	for _, id := range []string{kept[0].id, "during-0"} {
		e.deleteNow(id)
		deletedUnseen[id] = true
	}
	e.image("tag", churnImage, "docker.io/library/emchurn:post")
	e.image("rm", "docker.io/library/emchurn:2")
	windowDone := time.Now()

	// The informers may subscribe again: each right after one of its
	// attempts was refused.
	opened := map[string]<-chan time.Time{}
	for name, g := range e.gates {
		opened[name] = g.openAfterNextRefusal()
	}
	openedAt := map[string]time.Time{}
	for name, ch := range opened {
		select {
		case at := <-ch:
			openedAt[name] = at
		case <-time.After(10 * time.Second):
			t.Fatalf("the %s informer did not try to subscribe within 10 s", name)
		}
	}
	readyAt := e.upToDate(map[string]func() containerd.InformerStats{"containers": ci.Stats, "images": ii.Stats}, relists, 20*time.Second)
	for _, name := range []string{"containers", "images"} {
		g := e.gates[name]
		fromOpen, fromServe, next := readyAt[name].Sub(openedAt[name]), readyAt[name].Sub(servedAt), g.nextAttempt(openedAt[name])
		t.Logf("containerd %s: %s informer up to date %v after its subscription could be made again, in the worst phase: "+
			"%v until its next attempt, then %v to subscribe and relist (%v after the daemon served; the window before took %v)",
			version, name, fromOpen.Round(time.Millisecond), next.Sub(openedAt[name]).Round(time.Millisecond),
			readyAt[name].Sub(next).Round(time.Millisecond), fromServe.Round(time.Millisecond), windowDone.Sub(servedAt).Round(time.Millisecond))
		assert.Less(t, fromOpen, time.Second, "the %s informer up to date within 1 s of the daemon being back", name)
	}

	// The rest of the churn.
	e.ops.resume()
	e.runs.resume()
	for _, p := range post {
		p.preRun = true
		go e.live(p)
	}
	require.NoError(t, d.Release("after"))
	require.NoError(t, d.Release("post"))
	_, err = d.Ctr("-n", churnNS, "containers", "label", "post-notask", "phase=after")
	require.NoError(t, err)
	require.NoError(t, d.ImportImage(churnNS, churnImageTwo))
	e.image("tag", churnImageTwo, "docker.io/library/emchurn-two:2")
	e.image("label", "docker.io/library/emchurn-two:2", "phase=after")
	e.image("rm", churnImageTwo)
	e.until("the churn to end", 120*time.Second, func() bool { return e.finished(e.all()...) })
	for _, l := range e.all() {
		if l.err != nil {
			t.Errorf("container %s: %v", l.id, l.err)
		}
	}

	// Quiet: the caches must come to equal the daemon's listings, and stay.
	var diffs []string
	deadline := time.Now().Add(20 * time.Second)
	for {
		diffs = e.differences(ci, ii)
		if len(diffs) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond) // polling the caches, with a deadline
	}
	for _, m := range []*eventmonitor.Monitor{ci.Monitor(), ii.Monitor()} {
		idle, cancel := context.WithTimeout(ctx, 10*time.Second)
		require.NoError(t, m.WaitIdle(idle))
		cancel()
	}
	if len(diffs) == 0 {
		diffs = e.differences(ci, ii)
	}
	assert.Empty(t, diffs, "the caches differ from the daemon's listings")

	// When the container informer's subscription was surely live: from its
	// sync until shortly before the kill, and from a little after it
	// subscribed again.
	heard := [][2]time.Time{{listening, killedAt.Add(-100 * time.Millisecond)},
		{e.gates["containers"].nextAttempt(openedAt["containers"]).Add(200 * time.Millisecond), time.Now()}}
	r := e.account(atRestart, killedAt, deletedUnseen, heard)
	cs, is := ci.Stats(), ii.Stats()
	t.Logf("containerd %s: %d containers, %d task lifetimes ended; %d differences at the end; exits delivered %d (%d exactly once, %d with the right status); "+
		"a TaskExit of the stream's wrong but informer right %d (stream said it more than once %d); stream reported neither TaskExit nor TaskDelete %d (informer right %d); "+
		"status lost at the daemon (informer said %d) %d; deleted while the informer could not see %d (of them unknown %d); "+
		"OOM kills marked at the exit %d, later %d, of %d; corrections: containers %d, images %d; relists %d/%d, refreshes %d/%d; took %v",
		version, len(e.all())+1, r.lifetimes, len(diffs), r.delivered, r.once, r.right, len(r.streamWrong), len(r.streamTwice), len(r.streamMissed), len(r.streamMissedRight),
		eventmonitor.UnknownExitCode, len(r.lostAtDaemon), len(r.deletedUnseen), len(r.deletedUnknown), len(r.oomAtExit), len(r.oomLater), r.ooms,
		cs.Corrections, is.Corrections, cs.Relists, is.Relists, cs.Refreshes, is.Refreshes, time.Since(began).Round(100*time.Millisecond))
	t.Logf("containerd %s: stream's TaskExit wrong %v; twice %v; stream silent %v (informer right %v); lost at the daemon %v; deleted unseen %v; "+
		"OOM marked later %v; no TaskOOM in the stream %v, or only while the informer had no subscription %v",
		version, r.streamWrong, r.streamTwice, r.streamMissed, r.streamMissedRight, r.lostAtDaemon, r.deletedUnseen, r.oomLater, r.oomUnsaid, r.oomUnheard)
	for _, s := range r.oomNever {
		t.Errorf("OOM-killed container whose TaskOOM the stream delivered, never marked OOMKilled by the informer: %s", s)
	}
	for _, line := range r.failures {
		t.Error(line)
	}
	if t.Failed() {
		t.Logf("informers' log:\n%s", e.log.String())
		t.Logf("daemon log (last 20000 bytes):\n%s", tail(d.Log(), 20000))
	}
}

// TestInformerKeepsAnOOMReportedAfterTheExit: containerd 1.6's shim may
// deliver a task's TaskOOM after its TaskExit, stamped before it (the churn
// test above saw #263 TaskExit stamped T, #264 TaskOOM stamped T-2.8ms); a
// TaskOOM may also come after the informer's exit wait reported the exit,
// or be re-sent by the shim after a daemon outage with its first attempt's
// timestamp, after a relist. The task was OOM-killed all the same, and the
// stream said so: the cache must say OOMKilled, not drop the TaskOOM as
// older news (as the informer did before it took TaskOOM as additive). But
// the same TaskOOM, delivered again once the container has a new task,
// must not mark that one: it is older than the task.
func TestInformerKeepsAnOOMReportedAfterTheExit(t *testing.T) {
	clk := testclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	f := fakecontainerd.New(t, fakecontainerd.WithClock(clk))
	ns := f.Namespace("emoom")
	ns.CreateContainer(fakecontainerd.Container{ID: "c"})
	ns.CreateTask("c", 10)
	ns.StartTask("c")
	got := &churnChanges[containerd.Container]{}
	l := logrus.New()
	l.SetOutput(io.Discard)
	inf, err := containerd.NewContainerInformer(f.Conn(), "emoom", got.handle, containerd.WithClock(clk),
		containerd.WithRelistPeriod(0), containerd.WithLogger(logrus.NewEntry(l)))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- inf.Run(runCtx) }()
	defer func() {
		stop()
		require.NoError(t, <-done)
	}()
	require.NoError(t, f.WaitSubscribers(ctx, 1))
	for !inf.HasSynced() {
		require.NoError(t, ctx.Err(), "the informer never synced")
		clk.Step(100 * time.Millisecond) // the subscription's timer, maybe not set yet
		time.Sleep(time.Millisecond)     // polling, with ctx's deadline
	}
	clk.Step(time.Millisecond)
	oom := ns.Quiet().OOM("c") // stamped now, delivered after the exit
	clk.Step(time.Millisecond)
	ns.ExitTask("c", 137)
	for c, _ := inf.Get("c"); c.Task == nil || c.Task.Status != containerd.TaskStopped; c, _ = inf.Get("c") {
		require.NoError(t, ctx.Err(), "the exit never reached the cache")
		time.Sleep(time.Millisecond) // polling the cache, with ctx's deadline
	}
	f.Deliver(oom)
	deadline := time.Now().Add(2 * time.Second)
	for c, _ := inf.Get("c"); !c.Task.OOMKilled; c, _ = inf.Get("c") {
		if time.Now().After(deadline) {
			var lines []string
			for _, ch := range got.list() {
				lines = append(lines, churnState(ch.Old)+" -> "+churnState(ch.New))
			}
			t.Fatalf("the TaskOOM delivered after the TaskExit, stamped before it, was dropped: container c is %s; changes:\n  %s",
				churnState(&c), strings.Join(lines, "\n  "))
		}
		time.Sleep(time.Millisecond) // polling the cache, with a deadline
	}

	clk.Step(time.Millisecond)
	ns.DeleteTask("c")
	clk.Step(time.Millisecond)
	ns.CreateTask("c", 11)
	ns.StartTask("c")
	f.Deliver(oom) // the old lifetime's, again
	clk.Step(time.Millisecond)
	ns.ExitTask("c", 0) // news after it, in the same key's order
	for c, _ := inf.Get("c"); c.Task == nil || c.Task.Pid != 11 || c.Task.Status != containerd.TaskStopped; c, _ = inf.Get("c") {
		require.NoError(t, ctx.Err(), "the new task's exit never reached the cache")
		time.Sleep(time.Millisecond) // polling the cache, with ctx's deadline
	}
	c, _ := inf.Get("c")
	assert.False(t, c.Task.OOMKilled, "the new task marked with the old one's TaskOOM")
}

// churnEnv is the test's daemon, its own connections to it, the informers'
// gates and what the churn did.
type churnEnv struct {
	t   *testing.T
	ctx context.Context
	d   *containerdtest.Daemon

	conn, rawConn, infConn *grpc.ClientConn
	containers             containersapi.ContainersClient
	tasks                  tasksapi.TasksClient
	images                 imagesapi.ImagesClient
	snapshots              snapshotsapi.SnapshotsClient
	events                 eventsapi.EventsClient

	runs, ops *churnPauser // creations (ctr run) at most churnRunners at once; every other call of the churn
	raw       *churnStream
	gates     map[string]*churnGate
	log       *churnLog

	contChanges  *churnChanges[containerd.Container]
	imageChanges *churnChanges[containerd.Image]
	ci           *containerd.Informer[containerd.Container]
	ii           *containerd.Informer[containerd.Image]

	mu    sync.Mutex
	lives map[string]*churnLife
	order []string
}

// churnLife is one container of the churn and what became of its task.
type churnLife struct {
	id, group string
	proc      containerdtest.Process
	flags     []string
	image     string // run from this image, not the rootfs
	keep      bool   // left as it stopped: neither task nor container deleted
	preRun    bool   // started by the test itself, not the churn

	done chan struct{}
	// Set before done closes, or (pid, ran) once started.
	ran       bool
	ranAt     time.Time
	pid       uint32
	waited    string    // what the churn's wait said: "exit N" or "gone"
	waitedAt  time.Time // when it did
	deleted   string    // what the task's delete said
	deletedAt time.Time // when the task's delete answered
	err       error
}

// code is the status the task's process really exits with.
func (l *churnLife) code() uint32 {
	if l.proc.OOM {
		return 137
	}
	return uint32(l.proc.ExitCode)
}

func newChurnEnv(t *testing.T, ctx context.Context, d *containerdtest.Daemon) *churnEnv {
	e := &churnEnv{t: t, ctx: ctx, d: d, runs: newChurnPauser(churnRunners), ops: newChurnPauser(0), raw: newChurnStream(),
		log: &churnLog{}, lives: map[string]*churnLife{}, gates: map[string]*churnGate{},
		contChanges: &churnChanges[containerd.Container]{}, imageChanges: &churnChanges[containerd.Image]{}}
	for _, c := range []**grpc.ClientConn{&e.conn, &e.rawConn, &e.infConn} {
		dialCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		conn, err := containerd.Dial(dialCtx, d.Address())
		cancel()
		require.NoError(t, err)
		t.Cleanup(func() { conn.Close() })
		*c = conn
	}
	e.containers = containersapi.NewContainersClient(e.conn)
	e.tasks = tasksapi.NewTasksClient(e.conn)
	e.images = imagesapi.NewImagesClient(e.conn)
	e.snapshots = snapshotsapi.NewSnapshotsClient(e.conn)
	e.events = eventsapi.NewEventsClient(e.conn)
	return e
}

// startInformers runs a container and an image informer of the namespace,
// each over a gate of its own on one connection, until the test ends.
func (e *churnEnv) startInformers() (*containerd.Informer[containerd.Container], *containerd.Informer[containerd.Image]) {
	t := e.t
	l := logrus.New()
	l.SetOutput(e.log)
	l.SetLevel(logrus.DebugLevel)
	logger := logrus.NewEntry(l)
	opts := []containerd.InformerOption{containerd.WithRelistPeriod(0), containerd.WithLogger(logger)}
	e.gates["containers"], e.gates["images"] = &churnGate{ClientConn: e.infConn}, &churnGate{ClientConn: e.infConn}
	ci, err := containerd.NewContainerInformer(e.gates["containers"], churnNS, e.contChanges.handle, opts...)
	require.NoError(t, err)
	ii, err := containerd.NewImageInformer(e.gates["images"], churnNS, e.imageChanges.handle, opts...)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 2)
	go func() { done <- ci.Run(ctx) }()
	go func() { done <- ii.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		assert.NoError(t, <-done)
		assert.NoError(t, <-done)
	})
	e.ci, e.ii = ci, ii
	for _, wait := range []func(context.Context) error{ci.WaitForSync, ii.WaitForSync} {
		syncCtx, cancel := context.WithTimeout(e.ctx, 20*time.Second)
		require.NoError(t, wait(syncCtx))
		cancel()
	}
	return ci, ii
}

// plan makes n short-lived containers: exits of 0 and of other codes, OOM
// kills, some from the image, some left stopped (first, so that they are
// done by the kill).
func (e *churnEnv) plan(n int) []*churnLife {
	codes := []int{1, 2, 3, 7, 42, 99, 125, 126, 127, 200, 254}
	var out []*churnLife
	keptCodes := []int{0, 9, -1, 64, 0, 11, -1, 2}
	for i, code := range keptCodes {
		l := churnLife{id: fmt.Sprintf("kept-%d", i), group: "kept", keep: true, proc: containerdtest.Process{ExitCode: code}}
		if code < 0 {
			l.proc = containerdtest.Process{OOM: true}
			l.flags = []string{"--memory-limit", churnOOMLimit}
		}
		out = append(out, e.add(l))
	}
	for i := len(out); i < n; i++ {
		l := churnLife{id: fmt.Sprintf("quick-%02d", i)}
		switch {
		case i%14 == 3:
			l.group, l.proc, l.flags = "oom", containerdtest.Process{OOM: true}, []string{"--memory-limit", churnOOMLimit}
		case i%14 == 8:
			l.group, l.image, l.proc = "image", churnImage, containerdtest.Process{ExitCode: i % 3}
		case i%2 == 0:
			l.group = "zero"
		default:
			l.group, l.proc = "code", containerdtest.Process{ExitCode: codes[i%len(codes)]}
		}
		out = append(out, e.add(l))
	}
	return out
}

func (e *churnEnv) add(l churnLife) *churnLife {
	e.mu.Lock()
	defer e.mu.Unlock()
	p := &l
	p.done = make(chan struct{})
	e.lives[p.id] = p
	e.order = append(e.order, p.id)
	return p
}

func (e *churnEnv) all() []*churnLife {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]*churnLife, 0, len(e.order))
	for _, id := range e.order {
		out = append(out, e.lives[id])
	}
	return out
}

// start runs l's container, detached, and reads its task's pid.
func (e *churnEnv) start(l *churnLife) error {
	flags := append([]string{"--label", "group=" + l.group}, l.flags...)
	var err error
	if l.image != "" {
		err = e.d.RunImage(churnNS, l.image, l.id, l.proc, flags...)
	} else {
		err = e.d.Run(churnNS, l.id, l.proc, flags...)
	}
	if err != nil {
		return err
	}
	var p *task.Process
	err = e.call(func(ctx context.Context) error {
		resp, err := e.tasks.Get(ctx, &tasksapi.GetRequest{ContainerID: l.id})
		p = resp.GetProcess()
		return err
	})
	if err != nil {
		return fmt.Errorf("reading the task just started: %w", err)
	}
	e.mu.Lock()
	l.ran, l.ranAt, l.pid = true, time.Now(), p.GetPid()
	e.mu.Unlock()
	return nil
}

// live is l's life, kubelet-like: run it, wait for its task to stop, delete
// the task, then the container, each retried across the outage.
func (e *churnEnv) live(l *churnLife) {
	err := e.liveErr(l)
	e.mu.Lock()
	l.err = err
	e.mu.Unlock()
	close(l.done)
}

func (e *churnEnv) liveErr(l *churnLife) error {
	if !l.preRun {
		e.runs.enter()
		err := e.start(l)
		e.runs.exit()
		if err != nil {
			return err
		}
	}
	waited, err := taskEnd(e.op, func(ctx context.Context) (*tasksapi.WaitResponse, error) {
		return e.tasks.Wait(ctx, &tasksapi.WaitRequest{ContainerID: l.id})
	})
	if err != nil {
		return fmt.Errorf("waiting for the task: %w", err)
	}
	e.mu.Lock()
	l.waited, l.waitedAt = waited, time.Now()
	e.mu.Unlock()
	if l.keep {
		return nil
	}
	return e.remove(l, e.op)
}

// taskEnd makes a Wait or Delete of a task through call: "exit N", or
// "gone" if the daemon has no such task.
func taskEnd[R interface{ GetExitStatus() uint32 }](call func(func(context.Context) error) error,
	rpc func(context.Context) (R, error)) (string, error) {
	var end string
	err := call(func(ctx context.Context) error {
		resp, err := rpc(ctx)
		switch {
		case status.Code(err) == codes.NotFound:
			end = "gone"
			return nil
		case err != nil:
			return err
		}
		end = fmt.Sprint("exit ", resp.GetExitStatus())
		return nil
	})
	return end, err
}

// remove deletes l's task, then its container and snapshot, through call;
// what is already gone is not an error.
func (e *churnEnv) remove(l *churnLife, call func(func(context.Context) error) error) error {
	deleted, err := taskEnd(call, func(ctx context.Context) (*tasksapi.DeleteResponse, error) {
		return e.tasks.Delete(ctx, &tasksapi.DeleteTaskRequest{ContainerID: l.id})
	})
	if err != nil {
		return fmt.Errorf("deleting the task: %w", err)
	}
	e.mu.Lock()
	l.deleted, l.deletedAt = deleted, time.Now()
	e.mu.Unlock()
	var snapshotter, key string
	err = call(func(ctx context.Context) error {
		resp, err := e.containers.Get(ctx, &containersapi.GetContainerRequest{ID: l.id})
		if status.Code(err) == codes.NotFound {
			return nil
		}
		snapshotter, key = resp.GetContainer().GetSnapshotter(), resp.GetContainer().GetSnapshotKey()
		return err
	})
	if err == nil {
		err = call(func(ctx context.Context) error {
			_, err := e.containers.Delete(ctx, &containersapi.DeleteContainerRequest{ID: l.id})
			if status.Code(err) == codes.NotFound {
				return nil
			}
			return err
		})
	}
	if err != nil {
		return fmt.Errorf("deleting the container: %w", err)
	}
	if key != "" {
		return call(func(ctx context.Context) error {
			_, err := e.snapshots.Remove(ctx, &snapshotsapi.RemoveSnapshotRequest{Snapshotter: snapshotter, Key: key})
			if status.Code(err) == codes.NotFound {
				return nil
			}
			return err
		})
	}
	return nil
}

// deleteNow deletes container id and its task, now, past the churn's pause.
func (e *churnEnv) deleteNow(id string) {
	e.t.Helper()
	e.mu.Lock()
	l := e.lives[id]
	e.mu.Unlock()
	require.NoError(e.t, e.remove(l, e.call))
}

// nsCtx is ctx for a call in the churn's namespace.
func nsCtx(ctx context.Context) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "containerd-namespace", churnNS)
}

// call calls f in the namespace until it answers other than Unavailable,
// as a daemon coming back does for a moment, for up to 30 s.
func (e *churnEnv) call(f func(ctx context.Context) error) error {
	for deadline := time.Now().Add(30 * time.Second); ; {
		err := f(nsCtx(e.ctx))
		if status.Code(err) != codes.Unavailable || e.ctx.Err() != nil || time.Now().After(deadline) {
			return err
		}
		e.conn.ResetConnectBackoff()
		select { // the retry's pace
		case <-e.ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// op is call for the churn: each attempt waits while the churn is paused
// (from before the kill until the informers are up to date).
func (e *churnEnv) op(f func(ctx context.Context) error) error {
	for deadline := time.Now().Add(2 * time.Minute); ; {
		e.ops.enter()
		err := f(nsCtx(e.ctx))
		e.ops.exit()
		if status.Code(err) != codes.Unavailable || e.ctx.Err() != nil || time.Now().After(deadline) {
			return err
		}
		e.conn.ResetConnectBackoff()
		select { // the retry's pace
		case <-e.ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// image runs ctr images with args in the namespace.
func (e *churnEnv) image(args ...string) {
	e.t.Helper()
	_, err := e.d.Ctr(append([]string{"-n", churnNS, "images"}, args...)...)
	require.NoError(e.t, err)
}

// until waits for cond, failing the test after timeout.
func (e *churnEnv) until(what string, timeout time.Duration, cond func() bool) {
	e.t.Helper()
	for deadline := time.Now().Add(timeout); !cond(); {
		if time.Now().After(deadline) || e.ctx.Err() != nil {
			e.t.Fatalf("waiting for %s: not within %v", what, timeout)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition, with a deadline
	}
}

// waitStopped waits until container id's task is stopped.
func (e *churnEnv) waitStopped(id string) {
	e.t.Helper()
	e.until(id+"'s task to stop", 20*time.Second, func() bool {
		resp, err := e.tasks.Get(nsCtx(e.ctx), &tasksapi.GetRequest{ContainerID: id})
		return err == nil && resp.GetProcess().GetStatus() == task.Status_STOPPED
	})
}

func (e *churnEnv) started(ls ...*churnLife) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for _, l := range ls {
		if l.ran {
			n++
		}
	}
	return n
}

func (e *churnEnv) finished(ls ...*churnLife) bool {
	for _, l := range ls {
		select {
		case <-l.done:
		default:
			return false
		}
	}
	return true
}

// running is the IDs of ls whose process is alive.
func (e *churnEnv) running(ls []*churnLife) map[string]bool {
	out := map[string]bool{}
	for _, l := range ls {
		if churnAlive(l.pid) {
			out[l.id] = true
		}
	}
	return out
}

// probe publishes a probe in the namespace until the raw subscription has
// it: containerd registers a subscriber a moment after Subscribe returns.
func (e *churnEnv) probe(what string) {
	e.t.Helper()
	name := fmt.Sprintf("probe-%d", time.Now().UnixNano())
	payload, err := typeurl.MarshalAnyToProto(&events.NamespaceUpdate{Name: name})
	require.NoError(e.t, err)
	e.until(what+" to receive a probe", 20*time.Second, func() bool {
		if e.raw.probed(name) {
			return true
		}
		// Errors are expected while a restarted daemon comes up.
		if _, err := e.events.Publish(nsCtx(e.ctx), &eventsapi.PublishRequest{Topic: "/eventmonitor-test/probe", Event: payload}); err != nil {
			e.conn.ResetConnectBackoff()
		}
		return false
	})
}

// view is the daemon's own listing of the namespace, as the informers'
// types: containers with their task, and images.
func (e *churnEnv) view() (map[string]*containerd.Container, map[string]*containerd.Image, error) {
	var (
		cs  *containersapi.ListContainersResponse
		ts  *tasksapi.ListTasksResponse
		ims *imagesapi.ListImagesResponse
	)
	err := e.call(func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		var err error
		if cs, err = e.containers.List(ctx, &containersapi.ListContainersRequest{}); err != nil {
			return err
		}
		if ts, err = e.tasks.List(ctx, &tasksapi.ListTasksRequest{}); err != nil {
			return err
		}
		ims, err = e.images.List(ctx, &imagesapi.ListImagesRequest{})
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	containers := map[string]*containerd.Container{}
	for _, c := range cs.GetContainers() {
		containers[c.GetID()] = &containerd.Container{ID: c.GetID(), Image: c.GetImage(), Runtime: c.GetRuntime().GetName(),
			Labels: c.GetLabels(), CreatedAt: c.GetCreatedAt().AsTime()}
	}
	for _, p := range ts.GetTasks() {
		c := containers[p.GetID()] // ID, not ContainerID, which is empty in 1.6 and 2.4.2
		if c == nil {
			continue
		}
		t := &containerd.Task{Pid: p.GetPid(), Status: churnStatus(p.GetStatus())}
		if t.Status == containerd.TaskStopped {
			t.ExitStatus, t.ExitedAt = p.GetExitStatus(), p.GetExitedAt().AsTime()
		}
		c.Task = t
	}
	images := map[string]*containerd.Image{}
	for _, im := range ims.GetImages() {
		images[im.GetName()] = &containerd.Image{Name: im.GetName(), Target: im.GetTarget().GetDigest(), Labels: im.GetLabels(),
			UpdatedAt: im.GetUpdatedAt().AsTime()}
	}
	return containers, images, nil
}

func churnStatus(s task.Status) containerd.TaskStatus {
	switch s {
	case task.Status_CREATED:
		return containerd.TaskCreated
	case task.Status_RUNNING:
		return containerd.TaskRunning
	case task.Status_PAUSED, task.Status_PAUSING:
		return containerd.TaskPaused
	case task.Status_STOPPED:
		return containerd.TaskStopped
	}
	return containerd.TaskUnknown
}

// differences lists where the caches differ from the daemon's listing.
func (e *churnEnv) differences(ci *containerd.Informer[containerd.Container], ii *containerd.Informer[containerd.Image]) []string {
	containers, images, err := e.view()
	if err != nil {
		return []string{fmt.Sprintf("listing the daemon: %v", err)}
	}
	return append(containerDiffs(containers, ci.List()), imageDiffs(images, ii.List())...)
}

func containerDiffs(want map[string]*containerd.Container, cached []containerd.Container) []string {
	var out []string
	got := map[string]containerd.Container{}
	for _, c := range cached {
		got[c.ID] = c
	}
	for _, id := range slices.Sorted(maps.Keys(want)) {
		w := want[id]
		g, ok := got[id]
		if !ok {
			out = append(out, fmt.Sprintf("container %s: not in the cache; the daemon has %s", id, churnTask(w.Task)))
			continue
		}
		var fields []string
		if g.Image != w.Image {
			fields = append(fields, fmt.Sprintf("image %q, daemon %q", g.Image, w.Image))
		}
		if g.Runtime != w.Runtime {
			fields = append(fields, fmt.Sprintf("runtime %q, daemon %q", g.Runtime, w.Runtime))
		}
		if !maps.Equal(g.Labels, w.Labels) {
			fields = append(fields, fmt.Sprintf("labels %v, daemon %v", g.Labels, w.Labels))
		}
		if !g.CreatedAt.Equal(w.CreatedAt) {
			fields = append(fields, fmt.Sprintf("created %v, daemon %v", g.CreatedAt, w.CreatedAt))
		}
		if churnTask(g.Task) != churnTask(w.Task) {
			fields = append(fields, fmt.Sprintf("task %s, daemon %s", churnTask(g.Task), churnTask(w.Task)))
		}
		if len(fields) > 0 {
			out = append(out, fmt.Sprintf("container %s: cache has %s", id, strings.Join(fields, "; ")))
		}
	}
	for _, id := range slices.Sorted(maps.Keys(got)) {
		if want[id] == nil {
			g := got[id]
			out = append(out, fmt.Sprintf("container %s: in the cache (task %s), not in the daemon", id, churnTask(g.Task)))
		}
	}
	return out
}

// churnTask says what the listing says of a task.
func churnTask(t *containerd.Task) string {
	switch {
	case t == nil:
		return "no task"
	case t.Status == containerd.TaskStopped:
		return fmt.Sprintf("pid %d stopped, exit %d at %s", t.Pid, t.ExitStatus, t.ExitedAt.Format(time.RFC3339Nano))
	}
	return fmt.Sprintf("pid %d %s", t.Pid, t.Status)
}

func imageDiffs(want map[string]*containerd.Image, cached []containerd.Image) []string {
	var out []string
	got := map[string]containerd.Image{}
	for _, im := range cached {
		got[im.Name] = im
	}
	for _, name := range slices.Sorted(maps.Keys(want)) {
		w := want[name]
		g, ok := got[name]
		switch {
		case !ok:
			out = append(out, fmt.Sprintf("image %s: not in the cache", name))
		case g.Target != w.Target || !maps.Equal(g.Labels, w.Labels) || !g.UpdatedAt.Equal(w.UpdatedAt):
			out = append(out, fmt.Sprintf("image %s: cache has %s %v %v, daemon %s %v %v", name, g.Target, g.Labels, g.UpdatedAt, w.Target, w.Labels, w.UpdatedAt))
		}
	}
	for _, name := range slices.Sorted(maps.Keys(got)) {
		if want[name] == nil {
			out = append(out, fmt.Sprintf("image %s: in the cache, not in the daemon", name))
		}
	}
	return out
}

// upToDate waits until each informer has applied a relist since relists
// and its cache equals the daemon's listing, and returns when each did.
func (e *churnEnv) upToDate(stats map[string]func() containerd.InformerStats, relists map[string]uint64, timeout time.Duration) map[string]time.Time {
	e.t.Helper()
	ready := map[string]time.Time{}
	var last []string
	for deadline := time.Now().Add(timeout); len(ready) < len(stats); {
		if time.Now().After(deadline) {
			e.t.Fatalf("the informers were not up to date within %v of the daemon being back (up to date: %v); differences:\n%s",
				timeout, slices.Collect(maps.Keys(ready)), strings.Join(last, "\n"))
		}
		relisted := map[string]bool{}
		for name, s := range stats {
			relisted[name] = ready[name].IsZero() && s().Relists > relists[name]
		}
		if relisted["containers"] || relisted["images"] {
			now := time.Now()
			containers, images, err := e.view()
			if err == nil {
				diffs := map[string][]string{"containers": containerDiffs(containers, e.ci.List()),
					"images": imageDiffs(images, e.ii.List())}
				last = append(diffs["containers"], diffs["images"]...)
				for name := range stats {
					if relisted[name] && len(diffs[name]) == 0 {
						ready[name] = now
					}
				}
			}
		}
		time.Sleep(2 * time.Millisecond) // polling the caches, with a deadline
	}
	return ready
}

// churnReport is the exits' account.
type churnReport struct {
	lifetimes, delivered, once, right, ooms int
	// The containers of each case.
	streamWrong, streamTwice, streamMissed, streamMissedRight []string
	lostAtDaemon, deletedUnseen, deletedUnknown               []string
	oomAtExit, oomLater, oomNever, oomUnsaid, oomUnheard      []string
	failures                                                  []string
}

// account checks that every task lifetime's exit was delivered exactly
// once, with the right status or, where nobody can know it, UnknownExitCode,
// and counts what the stream alone would have said.
func (e *churnEnv) account(atRestart map[string]*containerd.Container, killedAt time.Time, deletedUnseen map[string]bool, heard [][2]time.Time) churnReport {
	var r churnReport
	type lifetime struct {
		id  string
		pid uint32
	}
	stops := map[lifetime][]containerd.Task{}
	stoppedAt := map[lifetime]time.Time{} // when the first change into Stopped arrived
	oom := map[lifetime]bool{}            // marked OOMKilled at some point
	history := map[string][]string{}
	times := e.contChanges.times()
	for i, ch := range e.contChanges.list() {
		id := churnID(ch)
		history[id] = append(history[id], fmt.Sprintf("%s -> %s (at %s)", churnState(ch.Old), churnState(ch.New), times[i].Format("15:04:05.000")))
		for _, c := range []*containerd.Container{ch.Old, ch.New} {
			if c == nil {
				continue
			}
			for _, t := range []*containerd.Task{c.Task, c.LastExit} {
				if t != nil && t.OOMKilled {
					oom[lifetime{id, t.Pid}] = true
				}
			}
		}
		if ch.New == nil || ch.New.Task == nil {
			continue
		}
		was := (*containerd.Task)(nil)
		if ch.Old != nil {
			was = ch.Old.Task
		}
		if ch.New.Task.Status == containerd.TaskStopped && (was == nil || was.Status != containerd.TaskStopped || was.Pid != ch.New.Task.Pid) {
			k := lifetime{id, ch.New.Task.Pid}
			stops[k] = append(stops[k], *ch.New.Task)
			if _, ok := stoppedAt[k]; !ok {
				stoppedAt[k] = times[i]
			}
		}
		if was != nil && was.Status == containerd.TaskStopped && was.Pid == ch.New.Task.Pid && ch.New.Task.Status != containerd.TaskStopped {
			r.failures = append(r.failures, fmt.Sprintf("container %s: a stopped task ran again; changes:\n  %s", id, strings.Join(history[id], "\n  ")))
		}
	}
	known := map[lifetime]bool{}
	for _, l := range e.all() {
		if !l.ran {
			continue
		}
		k := lifetime{l.id, l.pid}
		known[k] = true
		r.lifetimes++
		got := stops[k]
		why := func(format string, args ...any) {
			r.failures = append(r.failures, fmt.Sprintf("container %s (pid %d, %s, exits %d; churn's wait said %q, delete %q; stream: %s): %s; changes:\n  %s",
				l.id, l.pid, l.group, l.code(), l.waited, l.deleted, e.raw.story(l.id, killedAt), fmt.Sprintf(format, args...), strings.Join(history[l.id], "\n  ")))
		}
		if len(got) == 0 {
			why("its exit was never delivered")
			continue
		}
		r.delivered++
		if len(got) > 1 {
			why("its exit was delivered %d times", len(got))
			continue
		}
		r.once++
		s := got[0]
		if l.proc.OOM {
			r.ooms++
			switch {
			case s.OOMKilled:
				r.oomAtExit = append(r.oomAtExit, l.id)
			case oom[k]:
				r.oomLater = append(r.oomLater, l.id)
			case !e.raw.oomed(l.id, nil):
				r.oomUnsaid = append(r.oomUnsaid, l.id)
			case !e.raw.oomed(l.id, heard):
				r.oomUnheard = append(r.oomUnheard, l.id)
			default:
				r.oomNever = append(r.oomNever, fmt.Sprintf("%s: relative to the informer's change into Stopped (exit %d at %s), the churn's own wait returned at %+.1fms; the raw stream had: %s",
					l.id, s.ExitStatus, s.ExitedAt.Sub(stoppedAt[k]), float64(l.waitedAt.Sub(stoppedAt[k]).Microseconds())/1000, e.raw.story(l.id, stoppedAt[k])))
			}
		}
		exits, deletes := e.raw.ends(l.id, l.pid)
		// The daemon had no record of the task at the restart, though the
		// churn had not deleted it: it lost it (2.4.2 does so with every
		// task whose process is gone). Or the test deleted it where the
		// informer could not see: just before the kill, or in the window.
		deletedBefore := !l.deletedAt.IsZero() && l.deletedAt.Before(killedAt)
		c := atRestart[l.id]
		lost := l.ranAt.Before(killedAt) && !deletedBefore && (c == nil || c.Task == nil || c.Task.Pid != l.pid)
		unseen := deletedUnseen[l.id] || deletedBefore
		if len(exits) == 0 && len(deletes) == 0 {
			r.streamMissed = append(r.streamMissed, l.id)
		}
		switch {
		case s.ExitStatus == l.code():
			r.right++
			if slices.ContainsFunc(exits, func(s uint32) bool { return s != l.code() }) {
				r.streamWrong = append(r.streamWrong, fmt.Sprintf("%s%v", l.id, exits))
			}
			if len(exits) > 1 {
				r.streamTwice = append(r.streamTwice, fmt.Sprintf("%s%v", l.id, exits))
			}
			if len(exits) == 0 && len(deletes) == 0 {
				r.streamMissedRight = append(r.streamMissedRight, l.id)
			}
			if deletedUnseen[l.id] {
				r.deletedUnseen = append(r.deletedUnseen, l.id)
			}
		case s.ExitStatus == eventmonitor.UnknownExitCode && lost:
			r.lostAtDaemon = append(r.lostAtDaemon, l.id)
		case s.ExitStatus == eventmonitor.UnknownExitCode && unseen:
			r.deletedUnseen = append(r.deletedUnseen, l.id)
			r.deletedUnknown = append(r.deletedUnknown, l.id)
		default:
			why("delivered exit status %d, want %d", s.ExitStatus, l.code())
		}
	}
	for k, got := range stops {
		if !known[k] {
			r.failures = append(r.failures, fmt.Sprintf("container %s: %d exits delivered for pid %d, a task the churn did not start; changes:\n  %s",
				k.id, len(got), k.pid, strings.Join(history[k.id], "\n  ")))
		}
	}
	slices.Sort(r.failures)
	return r
}

func churnID(ch containerd.Change[containerd.Container]) string {
	if ch.New != nil {
		return ch.New.ID
	}
	return ch.Old.ID
}

func churnState(c *containerd.Container) string {
	switch {
	case c == nil:
		return "none"
	case c.Task == nil && c.LastExit != nil:
		return fmt.Sprintf("no task (last: %s)", churnTask(c.LastExit))
	}
	s := churnTask(c.Task)
	if c.Task != nil && c.Task.OOMKilled {
		s += " oom"
	}
	return s
}

// churnAlive reports whether pid is a process that has not exited.
func churnAlive(pid uint32) bool {
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(int(pid)) + "/stat")
	if err != nil {
		return false
	}
	fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	return len(fields) > 0 && fields[0] != "Z" && fields[0] != "X"
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}

// churnPauser lets calls through, at most max at once (0: no bound), until
// paused.
type churnPauser struct {
	mu     sync.Mutex
	cond   *sync.Cond
	max    int
	active int
	paused bool
}

func newChurnPauser(max int) *churnPauser {
	p := &churnPauser{max: max}
	p.cond = sync.NewCond(&p.mu)
	return p
}

func (p *churnPauser) enter() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.paused || p.max > 0 && p.active >= p.max {
		p.cond.Wait()
	}
	p.active++
}

func (p *churnPauser) exit() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.active--
	p.cond.Broadcast()
}

// pause lets no new call through; calls in progress go on.
func (p *churnPauser) pause() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.paused = true
}

// pauseAndDrain pauses and waits for the calls in progress.
func (p *churnPauser) pauseAndDrain() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.paused = true
	for p.active > 0 {
		p.cond.Wait()
	}
}

func (p *churnPauser) resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.paused = false
	p.cond.Broadcast()
}

// churnGate is an informer's connection, which refuses its subscriptions
// while held, as a daemon still down would, and passes every other call.
type churnGate struct {
	*grpc.ClientConn // for the informer's calls, and to wake the connection
	mu               sync.Mutex
	held, openNext   bool
	opened           chan time.Time
	attempts         []time.Time
}

const churnSubscribe = "/containerd.services.events.v1.Events/Subscribe"

func (g *churnGate) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	if method == churnSubscribe {
		g.mu.Lock()
		now := time.Now()
		g.attempts = append(g.attempts, now)
		held := g.held
		if held && g.openNext {
			g.held, g.openNext = false, false
			g.opened <- now
		}
		g.mu.Unlock()
		if held {
			return nil, status.Error(codes.Unavailable, "test: the informer's subscriptions are held")
		}
	}
	return g.ClientConn.NewStream(ctx, desc, method, opts...)
}

func (g *churnGate) hold() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.held, g.opened = true, make(chan time.Time, 1)
}

// openAfterNextRefusal lets subscriptions through once one more has been
// refused; the channel says when that was.
func (g *churnGate) openAfterNextRefusal() <-chan time.Time {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.openNext = true
	return g.opened
}

// nextAttempt is when the informer first tried to subscribe after at.
func (g *churnGate) nextAttempt(at time.Time) time.Time {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, a := range g.attempts {
		if a.After(at) {
			return a
		}
	}
	return time.Time{}
}

// churnChanges records an informer's changes.
type churnChanges[T any] struct {
	mu  sync.Mutex
	all []containerd.Change[T]
	at  []time.Time // when each arrived
}

func (c *churnChanges[T]) handle(_ context.Context, ch containerd.Change[T]) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.all = append(c.all, ch)
	c.at = append(c.at, time.Now())
	return nil
}

func (c *churnChanges[T]) times() []time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.at)
}

func (c *churnChanges[T]) list() []containerd.Change[T] {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.all)
}

// churnStream is a raw subscription to the namespace's events: what the
// stream alone said.
type churnStream struct {
	mu      sync.Mutex
	exits   map[string][]churnEnd // the init process's TaskExit, by container
	deletes map[string][]churnEnd
	ooms    map[string][]churnEnd
	removed map[string]int // the first ContainerDelete's place in the stream
	probes  map[string]bool
	seq     int
}

type churnEnd struct {
	pid, status uint32
	at, stamp   time.Time // when it arrived, and its envelope's timestamp
	seq         int       // its place in the stream
}

func newChurnStream() *churnStream {
	return &churnStream{exits: map[string][]churnEnd{}, deletes: map[string][]churnEnd{}, ooms: map[string][]churnEnd{}, removed: map[string]int{}, probes: map[string]bool{}}
}

// start subscribes until ctx ends or stop is called, again at once after
// the stream breaks.
func (s *churnStream) start(ctx context.Context, conn *grpc.ClientConn) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	sub := containerd.NewSubscriber(conn)
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			ch, errs := sub.Subscribe(ctx, `namespace=="`+churnNS+`"`)
			for env := range ch {
				s.record(env)
			}
			<-errs
			select { // the retry's pace
			case <-ctx.Done():
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	return func() { cancel(); <-done }
}

func (s *churnStream) record(env *eventmonitor.Envelope) {
	if env.Event == nil {
		return
	}
	v, err := typeurl.UnmarshalAny(env.Event)
	if err != nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	switch e := v.(type) {
	case *events.TaskExit:
		if e.ID == e.ContainerID {
			s.exits[e.ContainerID] = append(s.exits[e.ContainerID], churnEnd{e.Pid, e.ExitStatus, time.Now(), env.Timestamp, s.seq})
		}
	case *events.TaskDelete:
		if e.ID == "" || e.ID == e.ContainerID {
			s.deletes[e.ContainerID] = append(s.deletes[e.ContainerID], churnEnd{e.Pid, e.ExitStatus, time.Now(), env.Timestamp, s.seq})
		}
	case *events.ContainerDelete:
		if s.removed[e.ID] == 0 {
			s.removed[e.ID] = s.seq
		}
	case *events.TaskOOM:
		s.ooms[e.ContainerID] = append(s.ooms[e.ContainerID], churnEnd{at: time.Now(), stamp: env.Timestamp, seq: s.seq})
	case *events.NamespaceUpdate:
		s.probes[e.Name] = true
	}
}

func (s *churnStream) probed(name string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.probes[name]
}

// ends is the statuses the stream's TaskExit and TaskDelete of container
// id's task of pid said, in order.
func (s *churnStream) ends(id string, pid uint32) (exits, deletes []uint32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range s.exits[id] {
		if e.pid == pid || e.pid == 0 {
			exits = append(exits, e.status)
		}
	}
	for _, e := range s.deletes[id] {
		if e.pid == pid || e.pid == 0 {
			deletes = append(deletes, e.status)
		}
	}
	return exits, deletes
}

// story says what the stream said of container id's task, with when it
// arrived, relative to since.
func (s *churnStream) story(id string, since time.Time) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	type line struct {
		seq int
		s   string
	}
	var lines []line
	at := func(e churnEnd) string {
		return fmt.Sprintf("#%d, arrived %+.1fms, stamped %+.1fms", e.seq, float64(e.at.Sub(since).Microseconds())/1000,
			float64(e.stamp.Sub(since).Microseconds())/1000)
	}
	for _, e := range s.exits[id] {
		lines = append(lines, line{e.seq, fmt.Sprintf("TaskExit %d pid %d (%s)", e.status, e.pid, at(e))})
	}
	for _, e := range s.deletes[id] {
		lines = append(lines, line{e.seq, fmt.Sprintf("TaskDelete %d pid %d (%s)", e.status, e.pid, at(e))})
	}
	for _, e := range s.ooms[id] {
		lines = append(lines, line{e.seq, fmt.Sprintf("TaskOOM (%s)", at(e))})
	}
	if len(lines) == 0 {
		return "nothing"
	}
	slices.SortFunc(lines, func(a, b line) int { return a.seq - b.seq })
	var out []string
	for _, l := range lines {
		out = append(out, l.s)
	}
	return strings.Join(out, ", ")
}

// oomed reports whether the stream said container id was OOM-killed; given
// windows, in one of them and before it said the task or the container was
// deleted (the daemon sends every subscriber its events in one order, so
// the informer had it while the task was still there).
func (s *churnStream) oomed(id string, windows [][2]time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range s.ooms[id] {
		if windows == nil {
			return true
		}
		if d := s.removed[id]; d != 0 && d < e.seq || len(s.deletes[id]) > 0 && s.deletes[id][0].seq < e.seq {
			continue
		}
		for _, w := range windows {
			if e.at.After(w[0]) && e.at.Before(w[1]) {
				return true
			}
		}
	}
	return false
}

// churnLog is the informers' log, kept for a failure's report.
type churnLog struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *churnLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *churnLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}
