package containerd_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	apitypes "github.com/containerd/containerd/api/types"
	"github.com/containerd/log"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
	"github.com/eventmonitor/eventmonitor/containerd/internal/fakecontainerd"
)

var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// changes records what an informer's handler was given, and fails the
// calls a test asks it to.
type changes[T any] struct {
	mu   sync.Mutex
	all  []containerd.Change[T]
	fail int // fail this many calls, then succeed
}

func (c *changes[T]) handle(_ context.Context, ch containerd.Change[T]) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.fail > 0 {
		c.fail--
		return errors.New("handler refused")
	}
	c.all = append(c.all, ch)
	return nil
}

func (c *changes[T]) list() []containerd.Change[T] {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]containerd.Change[T](nil), c.all...)
}

// informerEnv is a fake daemon, a fake clock and a container informer
// running on them.
type informerEnv struct {
	f   *fakecontainerd.Fake
	ns  fakecontainerd.Namespace
	clk *testclock.FakeClock
	inf *containerd.Informer[containerd.Container]
	got *changes[containerd.Container]
}

// startInformer runs a container informer of namespace k8s.io on a fake
// daemon until the test ends; prepare runs before Run, on the daemon.
func startInformer(t *testing.T, prepare func(ns fakecontainerd.Namespace), opts ...containerd.InformerOption) *informerEnv {
	t.Helper()
	e := &informerEnv{clk: testclock.NewFakeClock(epoch), got: &changes[containerd.Container]{}}
	e.f = fakecontainerd.New(t, fakecontainerd.WithClock(e.clk))
	e.ns = e.f.Namespace(containerd.K8sNamespace)
	if prepare != nil {
		prepare(e.ns)
	}
	var err error
	e.inf, err = containerd.NewContainerInformer(e.f.Conn(), containerd.K8sNamespace, e.got.handle,
		append([]containerd.InformerOption{containerd.WithClock(e.clk), containerd.WithLogger(quietLog()),
			containerd.WithRelistPeriod(0)}, opts...)...)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.inf.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	e.synced(t)
	return e
}

// synced waits for the informer's first listing and its subscription.
func (e *informerEnv) synced(t *testing.T) {
	t.Helper()
	waitSynced(t, e.f, e.clk, e.inf.WaitForSync)
}

// waitSynced establishes an informer's first subscription, as the clock
// moves past the initial resubscribe delay without a refusal, and waits for
// its first listing.
func waitSynced(t *testing.T, f *fakecontainerd.Fake, clk *testclock.FakeClock, wait func(context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, f.WaitSubscribers(ctx, 1))
	synced := func() bool {
		short, cancel := context.WithTimeout(ctx, time.Millisecond)
		defer cancel()
		return wait(short) == nil
	}
	for !synced() {
		require.NoError(t, ctx.Err(), "the informer never synced")
		clk.Step(100 * time.Millisecond) // the subscription's timer, maybe not set yet
	}
}

// settle waits until every change the cache has made reached the handler.
func (e *informerEnv) settle(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, e.inf.Monitor().WaitIdle(ctx))
}

// tick moves the clock a little, so that the next change has a later
// timestamp than the one before.
func (e *informerEnv) tick() { e.clk.Step(time.Millisecond) }

// eventually waits until the informer's view of id satisfies ok.
func (e *informerEnv) eventually(t *testing.T, id string, ok func(c containerd.Container, found bool) bool) containerd.Container {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		c, found := e.inf.Get(id)
		if ok(c, found) {
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("container %s: %s (found %v); changes: %s", id, state(&c), found, describe(e.got.list()))
		}
		time.Sleep(time.Millisecond) // polling the cache, with a deadline
	}
}

// delivered waits until n changes reached the handler, and returns them.
func (e *informerEnv) delivered(t *testing.T, n int) []containerd.Change[containerd.Container] {
	t.Helper()
	require.Eventually(t, func() bool { return len(e.got.list()) >= n }, 10*time.Second, time.Millisecond,
		"changes: %s", describe(e.got.list()))
	got := e.got.list()
	require.Len(t, got, n, "changes: %s", describe(got))
	return got
}

// stopped counts each id's changes into Stopped: one per task lifetime.
func stopped(chs []containerd.Change[containerd.Container]) map[string][]uint32 {
	out := map[string][]uint32{}
	for _, ch := range chs {
		if ch.New != nil && ch.New.Task != nil && ch.New.Task.Status == containerd.TaskStopped &&
			(ch.Old == nil || ch.Old.Task == nil || ch.Old.Task.Status != containerd.TaskStopped) {
			out[ch.New.ID] = append(out[ch.New.ID], ch.New.Task.ExitStatus)
		}
	}
	return out
}

func describe(chs []containerd.Change[containerd.Container]) string {
	s := ""
	for _, ch := range chs {
		s += fmt.Sprintf("\n  %s -> %s", state(ch.Old), state(ch.New))
	}
	return s
}

func state(c *containerd.Container) string {
	switch {
	case c == nil:
		return "none"
	case c.Task == nil:
		return c.ID + "(no task)"
	}
	return fmt.Sprintf("%s(%d %s %d)", c.ID, c.Task.Pid, c.Task.Status, c.Task.ExitStatus)
}

func TestInformerListsThenFollowsTheStream(t *testing.T) {
	e := startInformer(t, func(ns fakecontainerd.Namespace) {
		ns.CreateContainer(fakecontainerd.Container{ID: "old", Image: "busybox", Labels: map[string]string{"app": "a"}})
		ns.CreateTask("old", 10)
		ns.StartTask("old")
	})
	old, ok := e.inf.Get("old")
	require.True(t, ok)
	assert.Equal(t, "busybox", old.Image)
	assert.Equal(t, map[string]string{"app": "a"}, old.Labels)
	require.NotNil(t, old.Task)
	assert.Equal(t, containerd.Task{Pid: 10, Status: containerd.TaskRunning}, *old.Task)

	e.tick()
	e.ns.CreateContainer(fakecontainerd.Container{ID: "new", Image: "alpine", Runtime: "io.containerd.runc.v2", Labels: map[string]string{"app": "b"}})
	e.delivered(t, 2) // read while it exists: its labels are only in its record
	e.ns.CreateTask("new", 20)
	e.ns.StartTask("new")
	e.tick()
	e.ns.ExitTask("new", 3)
	exitedAt := e.clk.Now()
	e.ns.DeleteTask("new")
	e.ns.DeleteContainer("new")
	got := e.delivered(t, 7)
	assert.Nil(t, got[0].Old)
	assert.Equal(t, "old", got[0].New.ID, "the listing's container first")
	assert.Equal(t, map[string]string{"app": "b"}, got[1].New.Labels, "labels come from the daemon's record")
	assert.Equal(t, "io.containerd.runc.v2", got[1].New.Runtime)
	assert.Equal(t, containerd.TaskCreated, got[2].New.Task.Status)
	assert.Equal(t, containerd.TaskRunning, got[3].New.Task.Status)
	assert.Equal(t, map[string][]uint32{"new": {3}}, stopped(got))
	assert.Equal(t, exitedAt, got[4].New.Task.ExitedAt)
	assert.Nil(t, got[5].New.Task, "the task deleted")
	tomb := got[6]
	assert.Nil(t, tomb.New)
	require.NotNil(t, tomb.Old.LastExit, "the tombstone says how the container's task ended")
	assert.Equal(t, uint32(3), tomb.Old.LastExit.ExitStatus)
	assert.Equal(t, map[string]string{"app": "b"}, tomb.Old.Labels)
	_, ok = e.inf.Get("new")
	assert.False(t, ok)
	assert.Len(t, e.inf.List(), 1)
}

// The exit status is the daemon's record of the task, whatever the
// stream's TaskExit says (containerd 1.6 around a restart says 137 or 255).
func TestInformerTakesExitStatusFromTheDaemonsRecord(t *testing.T) {
	e := startInformer(t, func(ns fakecontainerd.Namespace) {
		ns.CreateContainer(fakecontainerd.Container{ID: "c"})
		ns.CreateTask("c", 10)
		ns.StartTask("c")
	})
	e.tick()
	e.ns.ExitTaskReporting("c", 59, 137)
	c := e.eventually(t, "c", func(c containerd.Container, _ bool) bool {
		return c.Task != nil && c.Task.Status == containerd.TaskStopped
	})
	assert.Equal(t, uint32(59), c.Task.ExitStatus)
	assert.Equal(t, map[string][]uint32{"c": {59}}, stopped(e.delivered(t, 2)))
}

// The stream may deliver a task's events late, out of order or twice;
// each task lifetime still has one stopped transition, with the right
// status, and a late event never undoes a newer one.
func TestInformerOrdersWhatTheStreamReorders(t *testing.T) {
	for _, tc := range []struct {
		name  string
		order []int // of create, start, exit, delete: the envelopes as delivered
	}{
		{"in order", []int{0, 1, 2, 3}},
		{"TaskDelete before TaskExit", []int{0, 1, 3, 2}},
		{"TaskExit before TaskStart", []int{0, 2, 1, 3}},
		{"everything twice", []int{0, 1, 2, 3, 0, 1, 2, 3}},
		{"only TaskDelete", []int{0, 1, 3}},
		{"no TaskStart", []int{0, 2, 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := startInformer(t, func(ns fakecontainerd.Namespace) { ns.CreateContainer(fakecontainerd.Container{ID: "c"}) })
			q := e.ns.Quiet()
			e.tick()
			envs := []*apitypes.Envelope{q.CreateTask("c", 10)}
			e.tick()
			envs = append(envs, q.StartTask("c"))
			e.tick()
			envs = append(envs, q.ExitTask("c", 7))
			e.tick()
			envs = append(envs, q.DeleteTask("c"))
			for _, i := range tc.order {
				e.f.Deliver(envs[i])
			}
			c := e.eventually(t, "c", func(c containerd.Container, _ bool) bool { return c.LastExit != nil })
			assert.Nil(t, c.Task)
			assert.Equal(t, uint32(7), c.LastExit.ExitStatus)
			e.tick()
			e.ns.DeleteContainer("c")
			e.eventually(t, "c", func(_ containerd.Container, found bool) bool { return !found })
			e.settle(t)
			got := e.got.list()
			assert.Equal(t, map[string][]uint32{"c": {7}}, stopped(got), describe(got))
			for _, ch := range got {
				if ch.Old != nil && ch.Old.Task != nil && ch.Old.Task.Status == containerd.TaskStopped && ch.New != nil && ch.New.Task != nil {
					t.Errorf("a stopped task ran again: %s", describe([]containerd.Change[containerd.Container]{ch}))
				}
			}
		})
	}
}

// An event published while the informer lists is applied once, whether the
// listing already saw its change or not.
func TestInformerAppliesAnEventDuringItsListingOnce(t *testing.T) {
	for _, between := range []string{fakecontainerd.ContainersListStream, fakecontainerd.TasksList} {
		t.Run(between, func(t *testing.T) {
			clk := testclock.NewFakeClock(epoch)
			f := fakecontainerd.New(t, fakecontainerd.WithClock(clk))
			ns := f.Namespace(containerd.K8sNamespace)
			ns.CreateContainer(fakecontainerd.Container{ID: "c"})
			ns.CreateTask("c", 10)
			ns.StartTask("c")
			f.OnCall(between, func(call int) {
				if call == 1 {
					clk.Step(time.Millisecond)
					ns.ExitTask("c", 4)
				}
			})
			got := &changes[containerd.Container]{}
			inf, err := containerd.NewContainerInformer(f.Conn(), containerd.K8sNamespace, got.handle,
				containerd.WithClock(clk), containerd.WithLogger(quietLog()), containerd.WithRelistPeriod(0))
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			go inf.Run(ctx)
			waitSynced(t, f, clk, inf.WaitForSync)
			require.Eventually(t, func() bool {
				c, _ := inf.Get("c")
				return c.Task != nil && c.Task.Status == containerd.TaskStopped
			}, 10*time.Second, time.Millisecond)
			require.Eventually(t, func() bool { return inf.Stats().Relists == 1 }, 10*time.Second, time.Millisecond)
			c, _ := inf.Get("c")
			assert.Equal(t, uint32(4), c.Task.ExitStatus)
			require.Eventually(t, func() bool { return len(stopped(got.list())) > 0 }, 10*time.Second, time.Millisecond)
			assert.Equal(t, map[string][]uint32{"c": {4}}, stopped(got.list()), describe(got.list()))
		})
	}
}

// A listing older than an exit the stream delivered does not bring the
// task back to life.
func TestInformerIgnoresAStaleListing(t *testing.T) {
	e := startInformer(t, func(ns fakecontainerd.Namespace) {
		ns.CreateContainer(fakecontainerd.Container{ID: "c"})
		ns.CreateTask("c", 10)
		ns.StartTask("c")
	}, containerd.WithRelistPeriod(time.Minute))
	before := e.f.Snapshot()
	e.tick()
	e.ns.ExitTask("c", 5)
	e.eventually(t, "c", func(c containerd.Container, _ bool) bool { return c.Task.Status == containerd.TaskStopped })
	// The daemon answers from before the exit, but with the listing's
	// start, the clock's now, after it.
	e.f.ServeSnapshot(before)
	e.f.OnCall(fakecontainerd.TasksList, func(int) { e.f.ServeSnapshot(nil) })
	relists := e.inf.Stats().Relists
	e.clk.Step(time.Minute)
	require.Eventually(t, func() bool { return e.inf.Stats().Relists > relists }, 10*time.Second, time.Millisecond)
	c, _ := e.inf.Get("c")
	assert.Equal(t, containerd.TaskStopped, c.Task.Status, describe(e.got.list()))
	assert.Equal(t, map[string][]uint32{"c": {5}}, stopped(e.delivered(t, 2)))
}

// What the stream missed while the daemon was down, a relist finds once it
// is back: every change once, counted as corrections.
func TestInformerRelistsAfterAnOutage(t *testing.T) {
	e := startInformer(t, func(ns fakecontainerd.Namespace) {
		for _, id := range []string{"exits", "deleted", "runs"} {
			ns.CreateContainer(fakecontainerd.Container{ID: id})
			ns.CreateTask(id, 10)
			ns.StartTask(id)
		}
	})
	e.delivered(t, 3)
	e.f.Down()
	e.tick()
	e.ns.ExitTask("exits", 8) // all lost with the daemon
	e.ns.ExitTask("deleted", 9)
	e.ns.DeleteTask("deleted")
	e.ns.DeleteContainer("deleted")
	e.ns.CreateContainer(fakecontainerd.Container{ID: "born", Labels: map[string]string{"new": "yes"}})
	e.f.Up()
	// Run re-subscribes after its backoff, on the fake clock.
	require.Eventually(t, func() bool {
		e.clk.Step(100 * time.Millisecond)
		return e.inf.Stats().Relists >= 2
	}, 10*time.Second, 10*time.Millisecond)
	e.settle(t)
	got := e.got.list()
	assert.Equal(t, map[string][]uint32{"exits": {8}, "deleted": {uint32(eventmonitor.UnknownExitCode)}}, stopped(got), describe(got))
	_, found := e.inf.Get("deleted")
	assert.False(t, found)
	born, found := e.inf.Get("born")
	assert.True(t, found)
	assert.Equal(t, map[string]string{"new": "yes"}, born.Labels)
	s := e.inf.Stats()
	assert.GreaterOrEqual(t, s.Corrections, uint64(3), "the deletion and the new container only the relist found (the exit, maybe the exit wait)")
	assert.Equal(t, 3, s.Objects)
}

// A daemon that goes away in the middle of a relist is listed again once it
// is back.
func TestInformerRelistsAgainAfterAnOutageMidListing(t *testing.T) {
	e := startInformer(t, func(ns fakecontainerd.Namespace) { ns.CreateContainer(fakecontainerd.Container{ID: "c"}) },
		containerd.WithRelistPeriod(time.Minute))
	e.f.OnCall(fakecontainerd.TasksList, func(call int) {
		if call == 2 { // the periodic relist's
			e.f.Down()
			e.ns.CreateTask("c", 10) // lost
			e.ns.StartTask("c")
			e.f.Up()
		}
	})
	e.clk.Step(time.Minute)
	require.Eventually(t, func() bool {
		e.clk.Step(100 * time.Millisecond)
		c, _ := e.inf.Get("c")
		return c.Task != nil && c.Task.Status == containerd.TaskRunning
	}, 10*time.Second, 10*time.Millisecond)
}

// A task whose TaskExit and TaskDelete the stream lost (2.4 under churn)
// is stopped by its exit wait, stamped with the exit time, even when news
// of another field (a label update) came after the exit and was applied
// first.
func TestInformerStopsATaskByItsExitWaitAfterNewerNews(t *testing.T) {
	e := startInformer(t, func(ns fakecontainerd.Namespace) {
		ns.CreateContainer(fakecontainerd.Container{ID: "c"})
		ns.CreateTask("c", 10)
		ns.StartTask("c")
	})
	hold := make(chan struct{})
	release := sync.OnceFunc(func() { close(hold) })
	defer release()
	replied := make(chan struct{}, 16)
	e.f.OnCall(fakecontainerd.TasksWait, func(int) { <-hold; replied <- struct{}{} }) // the wait's reply waits
	e.tick()
	e.ns.Quiet().ExitTask("c", 3) // TaskExit lost; TaskDelete will not come either
	e.tick()
	e.ns.UpdateContainer(fakecontainerd.Container{ID: "c", Labels: map[string]string{"tier": "x"}}) // published
	e.eventually(t, "c", func(c containerd.Container, _ bool) bool { return c.Labels["tier"] == "x" })
	release()
	select {
	case <-replied:
	case <-time.After(10 * time.Second):
		t.Fatal("the exit wait never answered")
	}
	c := e.eventually(t, "c", func(c containerd.Container, _ bool) bool {
		return c.Task != nil && c.Task.Status == containerd.TaskStopped
	})
	require.Equal(t, uint32(3), c.Task.ExitStatus)
	e.settle(t)
	require.Equal(t, map[string][]uint32{"c": {3}}, stopped(e.got.list()), describe(e.got.list()))
}

// A handler that fails is given the same change again, in order, while the
// cache already shows the newest state.
func TestInformerRetriesAFailedDelivery(t *testing.T) {
	e := startInformer(t, nil, containerd.WithDelivery(eventmonitor.WithBackoff(time.Second, time.Second)))
	e.got.mu.Lock()
	e.got.fail = 1
	e.got.mu.Unlock()
	e.ns.CreateContainer(fakecontainerd.Container{ID: "c"})
	e.ns.CreateTask("c", 10)
	e.eventually(t, "c", func(c containerd.Container, _ bool) bool { return c.Task != nil })
	require.Eventually(t, func() bool {
		e.clk.Step(100 * time.Millisecond)
		return len(e.got.list()) == 2
	}, 10*time.Second, 10*time.Millisecond)
	got := e.got.list()
	assert.Nil(t, got[0].Old, "the failed Added first")
	assert.NotNil(t, got[1].New.Task)
}

// Resync reads one object again, once for calls before the read begins.
func TestInformerResyncReadsOnce(t *testing.T) {
	e := startInformer(t, func(ns fakecontainerd.Namespace) { ns.CreateContainer(fakecontainerd.Container{ID: "c"}) })
	e.ns.Quiet().UpdateContainer(fakecontainerd.Container{ID: "c", Labels: map[string]string{"v": "2"}})
	gets := e.f.Calls(fakecontainerd.ContainersGet)
	for range 5 {
		e.inf.Resync("c")
	}
	c := e.eventually(t, "c", func(c containerd.Container, _ bool) bool { return c.Labels["v"] == "2" })
	assert.Equal(t, "2", c.Labels["v"])
	require.Eventually(t, func() bool { return e.inf.Stats().Refreshes >= 1 }, 10*time.Second, time.Millisecond)
	assert.LessOrEqual(t, e.f.Calls(fakecontainerd.ContainersGet)-gets, 2, "coalesced")
	assert.Equal(t, uint64(1), e.inf.Stats().Corrections)
}

func TestInformerMarksOOMAndIgnoresExecs(t *testing.T) {
	e := startInformer(t, func(ns fakecontainerd.Namespace) {
		ns.CreateContainer(fakecontainerd.Container{ID: "c"})
		ns.CreateTask("c", 10)
		ns.StartTask("c")
	})
	e.tick()
	e.ns.AddExec("c", "sh")
	e.ns.StartExec("c", "sh", 11)
	e.ns.ExitExec("c", "sh", 1)
	e.ns.OOM("c")
	e.ns.ExitTask("c", 137)
	c := e.eventually(t, "c", func(c containerd.Container, _ bool) bool {
		return c.Task.Status == containerd.TaskStopped && c.Task.OOMKilled
	})
	assert.Equal(t, uint32(137), c.Task.ExitStatus)
	assert.Equal(t, map[string][]uint32{"c": {137}}, stopped(e.delivered(t, 3)), "an exec's exit is not the task's")
}

func TestImageInformer(t *testing.T) {
	clk := testclock.NewFakeClock(epoch)
	f := fakecontainerd.New(t, fakecontainerd.WithClock(clk))
	ns := f.Namespace(containerd.K8sNamespace)
	ns.CreateImage(fakecontainerd.Image{Name: "busybox:1", Target: fakecontainerd.Descriptor{Digest: "sha256:a"}})
	got := &changes[containerd.Image]{}
	inf, err := containerd.NewImageInformer(f.Conn(), containerd.K8sNamespace, got.handle, containerd.WithClock(clk),
		containerd.WithLogger(quietLog()), containerd.WithRelistPeriod(0))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go inf.Run(ctx)
	waitSynced(t, f, clk, inf.WaitForSync)
	clk.Step(time.Millisecond)
	ns.CreateImage(fakecontainerd.Image{Name: "busybox:latest", Target: fakecontainerd.Descriptor{Digest: "sha256:a"}}) // a tag
	require.Eventually(t, func() bool { return len(got.list()) == 2 }, 10*time.Second, time.Millisecond)
	assert.Equal(t, "sha256:a", got.list()[1].New.Target, "the tag's target from the daemon's record")
	ns.UpdateImage(fakecontainerd.Image{Name: "busybox:1", Target: fakecontainerd.Descriptor{Digest: "sha256:b"}, Labels: map[string]string{"l": "1"}})
	ns.DeleteImage("busybox:latest")
	require.Eventually(t, func() bool { return len(got.list()) == 4 }, 10*time.Second, time.Millisecond)
	of := map[string][]containerd.Change[containerd.Image]{}
	for _, ch := range got.list() {
		name := ch.Old
		if name == nil {
			name = ch.New
		}
		of[name.Name] = append(of[name.Name], ch)
	}
	require.Len(t, of["busybox:1"], 2)
	assert.Equal(t, "sha256:b", of["busybox:1"][1].New.Target)
	require.Len(t, of["busybox:latest"], 2)
	assert.Nil(t, of["busybox:latest"][1].New, "deleted")
	assert.Equal(t, "sha256:a", of["busybox:latest"][1].Old.Target, "the tombstone")
	im, _ := inf.Get("busybox:1")
	assert.Equal(t, map[string]string{"l": "1"}, im.Labels)
	assert.Len(t, inf.List(), 1)
}

// quietLog discards every line: the informer's failures here are on purpose.
func quietLog() *log.Entry {
	l := logrus.New()
	l.SetOutput(io.Discard)
	return logrus.NewEntry(l)
}
