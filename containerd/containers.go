package containerd

import (
	"context"
	"errors"
	"io"
	"maps"
	"sync"
	"time"

	"github.com/containerd/containerd/api/events"
	containersapi "github.com/containerd/containerd/api/services/containers/v1"
	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/log"
	"github.com/sirupsen/logrus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/eventmonitor/eventmonitor"
)

// Container is a container as the informer caches it, with its task.
type Container struct {
	ID, Image, Runtime string
	Labels             map[string]string
	CreatedAt          time.Time
	Task               *Task // the current task; nil: none
	// LastExit is the final state of the container's last task once that
	// task was deleted, so that a tombstone still says how it ended.
	LastExit *Task
}

// Task is a container's task (its init process).
type Task struct {
	Pid    uint32
	Status TaskStatus
	// ExitStatus and ExitedAt, once Stopped, are the daemon's record, or
	// eventmonitor.UnknownExitCode and a zero time when the daemon lost it.
	ExitStatus uint32
	ExitedAt   time.Time
	OOMKilled  bool      // the kernel's OOM killer hit it (from the stream's TaskOOM)
	born       time.Time // when the informer first heard of it, for a TaskOOM's lifetime
}

// TaskStatus is a task's status as containerd reports it.
type TaskStatus string

const (
	TaskCreated TaskStatus = "created"
	TaskRunning TaskStatus = "running"
	TaskPaused  TaskStatus = "paused"
	TaskStopped TaskStatus = "stopped"
	TaskUnknown TaskStatus = "unknown"
)

// NewContainerInformer returns an informer of namespace's containers and
// their tasks over conn, which calls h with every change (see Informer).
// A task's exit is one change to Stopped per task lifetime, its status the
// daemon's record of the task.
func NewContainerInformer(conn grpc.ClientConnInterface, namespace string,
	h func(ctx context.Context, c Change[Container]) error, opts ...InformerOption) (*Informer[Container], error) {
	if conn == nil {
		return nil, errors.New("containerd: informer with a nil connection")
	}
	k := &containerKind{conn: conn, containers: containersapi.NewContainersClient(conn), tasks: tasksapi.NewTasksClient(conn),
		namespace: namespace, pending: map[string]pendingExit{}, waits: map[string]exitWait{}}
	return newInformer[Container](conn, namespace, k, h, opts)
}

// containerKind is the informer's adapter for containers.
type containerKind struct {
	conn       grpc.ClientConnInterface
	containers containersapi.ContainersClient
	tasks      tasksapi.TasksClient
	namespace  string

	mu sync.Mutex
	// pending holds exits the stream reported for tasks whose record was
	// already gone, until TaskDelete (the daemon's record at deletion), a
	// ContainerDelete or a listing ends the task.
	pending map[string]pendingExit
	// waits are the exit waits of live tasks (WaitExit), which report an
	// exit whose TaskExit and TaskDelete the stream lost.
	waits   map[string]exitWait
	waiting sync.WaitGroup  // the waits' goroutines
	runCtx  context.Context // Run's: the waits end with it
	submit  func(id string, news any) error
}

type exitWait struct {
	pid    uint32
	cancel context.CancelFunc
}

// waited is an exit wait's news: the task of pid exited.
type waited struct {
	pid    uint32
	status ExitStatus
}

func (k *containerKind) run(ctx context.Context, submit func(id string, news any) error) (wait func()) {
	quiet := logrus.New() // a wait's outage is the informer's, logged once
	quiet.SetOutput(io.Discard)
	k.mu.Lock()
	defer k.mu.Unlock()
	k.runCtx, k.submit = log.WithLogger(ctx, logrus.NewEntry(quiet)), submit
	return k.waiting.Wait
}

// settled waits for the exit of id's live task, and ends the wait of a task
// that is gone or stopped.
func (k *containerKind) settled(id string, c *Container) {
	k.mu.Lock()
	defer k.mu.Unlock()
	w, waiting := k.waits[id]
	live := c != nil && c.Task != nil && c.Task.Status != TaskStopped
	switch {
	case waiting && (!live || w.pid != c.Task.Pid):
		w.cancel()
		delete(k.waits, id)
		waiting = false
	}
	if !live || waiting || k.runCtx == nil {
		return
	}
	ctx, cancel := context.WithCancel(k.runCtx)
	k.waits[id] = exitWait{pid: c.Task.Pid, cancel: cancel}
	pid, submit := c.Task.Pid, k.submit
	waiter := newWaiter(k.conn, k.namespace, id, "")
	k.waiting.Add(1)
	go func() {
		defer k.waiting.Done()
		if s, ok := waiter.wait(ctx); ok && s.Error() == nil {
			_ = submit(id, stamped{event: waited{pid: pid, status: s}, at: s.ExitTime()}) // refused: the informer stops
		}
	}()
}

type pendingExit struct {
	pid, status uint32
	at          time.Time
}

func (k *containerKind) noun() string { return "container" }

func (k *containerKind) keys() []eventmonitor.TypeKey {
	return []eventmonitor.TypeKey{
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
	}
}

// list returns every container with its task. containerd 1.6 leaves a
// task's ContainerID empty in Tasks.List; its ID is the container's.
func (k *containerKind) list(ctx context.Context) (map[string]*Container, error) {
	ctx = metadata.AppendToOutgoingContext(ctx, namespaceHeader, k.namespace)
	stream, err := k.containers.ListStream(ctx, &containersapi.ListContainersRequest{})
	if err != nil {
		return nil, err
	}
	out := map[string]*Container{}
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, err
		}
		c := containerOf(msg.GetContainer())
		out[c.ID] = c
	}
	tasks, err := k.tasks.List(ctx, &tasksapi.ListTasksRequest{})
	if err != nil {
		return nil, err
	}
	for _, p := range tasks.GetTasks() {
		if c := out[p.GetID()]; c != nil {
			c.Task = taskOf(p)
		}
	}
	return out, nil
}

// read returns the container with id and its task; nil if there is none.
func (k *containerKind) read(ctx context.Context, id string) (*Container, error) {
	ctx, cancel := rpc(ctx, k.namespace)
	defer cancel()
	resp, err := k.containers.Get(ctx, &containersapi.GetContainerRequest{ID: id})
	if status.Code(err) == codes.NotFound {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	c := containerOf(resp.GetContainer())
	c.Task, err = k.readTask(ctx, id)
	return c, err
}

// readTask returns the task of container id, nil if it has none; ctx is
// rpc's.
func (k *containerKind) readTask(ctx context.Context, id string) (*Task, error) {
	resp, err := k.tasks.Get(ctx, &tasksapi.GetRequest{ContainerID: id})
	if status.Code(err) == codes.NotFound {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return taskOf(resp.GetProcess()), nil
}

func containerOf(c *containersapi.Container) *Container {
	return &Container{ID: c.GetID(), Image: c.GetImage(), Runtime: c.GetRuntime().GetName(),
		Labels: c.GetLabels(), CreatedAt: c.GetCreatedAt().AsTime()}
}

func taskOf(p *task.Process) *Task {
	t := &Task{Pid: p.GetPid(), Status: statusOf(p.GetStatus())}
	if t.Status == TaskStopped {
		t.ExitStatus, t.ExitedAt = p.GetExitStatus(), p.GetExitedAt().AsTime()
	}
	return t
}

func statusOf(s task.Status) TaskStatus {
	switch s {
	case task.Status_CREATED:
		return TaskCreated
	case task.Status_RUNNING:
		return TaskRunning
	case task.Status_PAUSED, task.Status_PAUSING:
		return TaskPaused
	case task.Status_STOPPED:
		return TaskStopped
	}
	return TaskUnknown
}

// apply moves a container through an event. A task's status only moves
// forward within its lifetime (created, running or paused, stopped), so a
// late or repeated event cannot undo an exit.
// additive: a TaskOOM only marks the task it follows, which no listing
// says, and may come a moment after the task's exit; an exit wait's news
// only stops a live task of its pid, which no newer news about another
// field of the container (a label update) undoes.
func (k *containerKind) additive(event any) bool {
	switch event.(type) {
	case *events.TaskOOM, waited:
		return true
	}
	return false
}

func (k *containerKind) apply(ctx context.Context, id string, cur *Container, event any, at time.Time) ([]*Container, bool, error) {
	if cur == nil {
		switch e := event.(type) {
		case *events.ContainerCreate:
			return k.created(ctx, e)
		case *events.ContainerDelete:
			return nil, false, nil
		}
		return nil, true, nil // news of a container not cached yet: read it
	}
	switch e := event.(type) {
	case *events.ContainerUpdate:
		next := *cur
		next.Image, next.Labels = e.Image, e.Labels
		return []*Container{&next}, false, nil
	case *events.ContainerDelete:
		return append(k.endTask(id, cur), nil), false, nil
	case *events.TaskCreate:
		return k.started(id, cur, e.Pid, TaskCreated, at), false, nil
	case *events.TaskStart:
		return k.started(id, cur, e.Pid, TaskRunning, at), false, nil
	case *events.TaskPaused:
		return k.moved(cur, TaskPaused), false, nil
	case *events.TaskResumed:
		return k.moved(cur, TaskRunning), false, nil
	case *events.TaskOOM:
		if cur.Task == nil || cur.Task.OOMKilled || at.Before(cur.Task.born) {
			return nil, false, nil // no task, or one that began after it
		}
		t := *cur.Task
		t.OOMKilled = true
		return []*Container{withTask(cur, &t)}, false, nil
	case *events.TaskExit:
		if e.ID != e.ContainerID || !k.ours(cur, e.Pid) {
			return nil, false, nil // an exec's exit, or another lifetime's
		}
		return k.exited(ctx, id, cur, e)
	case waited:
		if !k.ours(cur, e.pid) {
			return nil, false, nil
		}
		stopped := *cur.Task
		stopped.Status, stopped.ExitStatus, stopped.ExitedAt = TaskStopped, e.status.ExitCode(), e.status.ExitTime()
		return []*Container{withTask(cur, &stopped)}, false, nil
	case *events.TaskDelete:
		if e.ID != "" && e.ID != e.ContainerID || cur.Task == nil || !samePid(cur.Task.Pid, e.Pid) {
			return nil, false, nil
		}
		if cur.Task.Status != TaskStopped { // its exit never came: the daemon's record says it here
			k.setPending(id, pendingExit{pid: cur.Task.Pid, status: e.ExitStatus, at: e.ExitedAt.AsTime()})
		}
		return k.endTask(id, cur), false, nil
	}
	return nil, false, nil
}

// ours reports whether pid is the cached task's, a task not yet stopped.
func (k *containerKind) ours(cur *Container, pid uint32) bool {
	return cur.Task != nil && cur.Task.Status != TaskStopped && samePid(cur.Task.Pid, pid)
}

// samePid reports whether two pids may be one process's: 0 is unknown.
func samePid(a, b uint32) bool { return a == b || a == 0 || b == 0 }

// created adds a container the stream announced; its labels and creation
// time are only in the daemon's record.
func (k *containerKind) created(ctx context.Context, e *events.ContainerCreate) ([]*Container, bool, error) {
	c := &Container{ID: e.ID, Image: e.Image, Runtime: e.Runtime.GetName()}
	ctx, cancel := rpc(ctx, k.namespace)
	defer cancel()
	resp, err := k.containers.Get(ctx, &containersapi.GetContainerRequest{ID: e.ID})
	switch {
	case err == nil:
		c = containerOf(resp.GetContainer())
	case status.Code(err) != codes.NotFound: // NotFound: deleted already; its events still tell its story
		return nil, false, err
	}
	return []*Container{c}, false, nil
}

// started gives cur a task of pid in status s, begun at born, ending a
// lifetime the stream did not end first.
func (k *containerKind) started(id string, cur *Container, pid uint32, s TaskStatus, born time.Time) []*Container {
	if cur.Task != nil && cur.Task.Pid == pid {
		return k.moved(cur, s)
	}
	states := k.endTask(id, cur)
	return append(states, withTask(last(cur, states), &Task{Pid: pid, Status: s, born: born}))
}

// moved moves cur's task to s, if that is forward.
func (k *containerKind) moved(cur *Container, s TaskStatus) []*Container {
	if cur.Task == nil || !forward(cur.Task.Status, s) {
		return nil
	}
	t := *cur.Task
	t.Status = s
	return []*Container{withTask(cur, &t)}
}

// forward reports whether a task's status may move from a to b.
func forward(a, b TaskStatus) bool {
	rank := map[TaskStatus]int{TaskCreated: 0, TaskRunning: 1, TaskPaused: 1, TaskUnknown: 1, TaskStopped: 2}
	return rank[b] > rank[a] || rank[b] == 1 && rank[a] == 1 && a != b
}

// exited applies a TaskExit with the daemon's record of the task: the
// stream's status can be wrong (containerd 1.6 around a restart). Without
// a record of this lifetime, the exit waits for what ends the task.
func (k *containerKind) exited(ctx context.Context, id string, cur *Container, e *events.TaskExit) ([]*Container, bool, error) {
	ctx, cancel := rpc(ctx, k.namespace)
	defer cancel()
	t, err := k.readTask(ctx, id)
	switch {
	case err != nil:
		return nil, false, err
	case t == nil || !samePid(t.Pid, cur.Task.Pid):
		k.setPending(id, pendingExit{pid: e.Pid, status: e.ExitStatus, at: e.ExitedAt.AsTime()})
		return nil, false, nil
	case t.Status != TaskStopped:
		return nil, false, nil // the daemon does not confirm it: a listing will tell
	}
	stopped := *cur.Task
	stopped.Status, stopped.ExitStatus, stopped.ExitedAt = TaskStopped, t.ExitStatus, t.ExitedAt
	return []*Container{withTask(cur, &stopped)}, false, nil
}

func (k *containerKind) setPending(id string, p pendingExit) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.pending[id] = p
}

// endTask ends cur's task lifetime: stopped, if it was not, with the exit a
// pending record holds or UnknownExitCode; then deleted, its final state
// kept as LastExit.
func (k *containerKind) endTask(id string, cur *Container) []*Container {
	k.mu.Lock()
	p, ok := k.pending[id]
	delete(k.pending, id)
	k.mu.Unlock()
	if cur.Task == nil {
		return nil
	}
	var states []*Container
	t := *cur.Task
	if t.Status != TaskStopped {
		t.Status, t.ExitStatus, t.ExitedAt = TaskStopped, eventmonitor.UnknownExitCode, time.Time{}
		if ok && samePid(p.pid, t.Pid) {
			t.ExitStatus, t.ExitedAt = p.status, p.at
		}
		states = append(states, withTask(cur, &t))
	}
	gone := withTask(last(cur, states), nil)
	gone.LastExit = &t
	return append(states, gone)
}

// reconcile moves cur to what a listing showed: the daemon's record is the
// truth, but for a task's status, which only moves forward, and OOMKilled
// and LastExit, which no listing holds.
func (k *containerKind) reconcile(id string, cur, listed *Container) []*Container {
	switch {
	case listed == nil && cur == nil:
		return nil
	case listed == nil:
		return append(k.endTask(id, cur), nil)
	case cur == nil:
		return []*Container{listed}
	}
	base := *listed
	base.Task, base.LastExit = cur.Task, cur.LastExit
	lt := listed.Task
	switch ct := cur.Task; {
	case ct == nil || lt == nil && ct == nil:
		return []*Container{withTask(&base, lt)}
	case lt == nil:
		return k.endTask(id, &base)
	case lt.Pid != ct.Pid:
		states := k.endTask(id, &base)
		return append(states, withTask(last(&base, states), lt))
	}
	t := *lt
	t.OOMKilled = cur.Task.OOMKilled
	switch {
	case t.Status == cur.Task.Status, forward(cur.Task.Status, t.Status):
		k.mu.Lock()
		delete(k.pending, id)
		k.mu.Unlock()
		return []*Container{withTask(&base, &t)}
	}
	return []*Container{&base} // the listing is behind the task's own news
}

func (k *containerKind) equal(a, b *Container) bool {
	if a == nil || b == nil {
		return a == b
	}
	return sameTask(a.Task, b.Task) && sameTask(a.LastExit, b.LastExit) && a.ID == b.ID && a.Image == b.Image &&
		a.Runtime == b.Runtime && a.CreatedAt.Equal(b.CreatedAt) && maps.Equal(a.Labels, b.Labels) // the labels last: task events change the task
}

func sameTask(a, b *Task) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Pid == b.Pid && a.Status == b.Status && a.ExitStatus == b.ExitStatus &&
		a.ExitedAt.Equal(b.ExitedAt) && a.OOMKilled == b.OOMKilled
}

// withTask is a copy of c with task t.
func withTask(c *Container, t *Task) *Container {
	next := *c
	next.Task = t
	return &next
}

// last is the last of states, or c if there are none.
func last(c *Container, states []*Container) *Container {
	if len(states) == 0 {
		return c
	}
	return states[len(states)-1]
}

// Exited returns the task whose stop c is, if it is one: each task lifetime
// has exactly one such change.
func Exited(c Change[Container]) (*Task, bool) {
	n := c.New
	if n == nil || n.Task == nil || n.Task.Status != TaskStopped {
		return nil, false
	}
	if o := c.Old; o != nil && o.Task != nil && o.Task.Status == TaskStopped && o.Task.Pid == n.Task.Pid {
		return nil, false // a correction of a status already stopped
	}
	return n.Task, true
}
