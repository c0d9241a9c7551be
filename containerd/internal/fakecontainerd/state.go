package fakecontainerd

import (
	"fmt"
	"maps"
	"time"

	"github.com/containerd/containerd/api/events"
	"github.com/containerd/containerd/api/types"
	"github.com/containerd/containerd/api/types/task"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Container is a container's record. Runtime is the runtime's name, such
// as io.containerd.runc.v2.
type Container struct {
	ID, Image, Runtime   string
	Labels               map[string]string
	CreatedAt, UpdatedAt time.Time
}

// Process is a task's init process (ID is the container's) or one of its
// exec processes (ID is the exec's).
type Process struct {
	ID         string
	Pid        uint32
	Status     task.Status
	ExitStatus uint32
	ExitedAt   time.Time
}

// Image is an image's record; Target describes the content it names.
type Image struct {
	Name                 string
	Target               Descriptor
	Labels               map[string]string
	CreatedAt, UpdatedAt time.Time
}

// Descriptor describes content, as an image's target.
type Descriptor struct {
	MediaType, Digest string
	Size              int64
}

// nsState is one namespace's records. A Snapshot shares the records, so
// they are replaced, never changed in place (their Labels maps included).
type nsState struct {
	containers map[string]Container
	procs      map[procKey]Process // a task is its init process, exec ""
	images     map[string]Image
}

type procKey struct{ container, exec string }

func newState() *nsState {
	return &nsState{containers: map[string]Container{}, procs: map[procKey]Process{}, images: map[string]Image{}}
}

func (s *nsState) clone() *nsState {
	return &nsState{containers: maps.Clone(s.containers), procs: maps.Clone(s.procs), images: maps.Clone(s.images)}
}

// Namespace changes and reads one namespace. Each change publishes the event
// containerd would, stamped by the fake's clock, and returns it (nil if the
// change cannot be made: it then fails the test).
type Namespace struct {
	f     *Fake
	name  string
	quiet bool
}

// Quiet returns n changing the records without publishing: the event each
// change returns can be delivered later, out of order or twice, by Deliver.
func (n Namespace) Quiet() Namespace {
	n.quiet = true
	return n
}

// change applies fn and publishes its events under one lock, so that no
// listing sees a change whose events are not yet queued. A change that
// cannot be made fails the test and does nothing.
func (n Namespace) change(fn func(s *nsState, now time.Time) (proto.Message, error)) *types.Envelope {
	f := n.f
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.live[n.name]
	if s == nil {
		s = newState()
		f.live[n.name] = s
	}
	now := f.clock.Now()
	ev, err := fn(s, now)
	var topic string
	if err == nil {
		if topic = topics[string(ev.ProtoReflect().Descriptor().Name())]; topic == "" {
			err = fmt.Errorf("no topic for %T", ev)
		}
	}
	if err != nil {
		f.t.Errorf("fakecontainerd: namespace %s: %v", n.name, err)
		return nil
	}
	env := envelope(n.name, topic, now, mustAny(ev))
	if !n.quiet {
		f.publishLocked(env)
	}
	f.notifyLocked()
	return proto.CloneOf(env)
}

// CreateContainer records c, timestamped now unless it says otherwise.
func (n Namespace) CreateContainer(c Container) *types.Envelope {
	return n.change(func(s *nsState, now time.Time) (proto.Message, error) {
		if _, ok := s.containers[c.ID]; ok {
			return nil, fmt.Errorf("container %q exists", c.ID)
		}
		c.CreatedAt, c.Labels = or(c.CreatedAt, now), maps.Clone(c.Labels)
		c.UpdatedAt = or(c.UpdatedAt, c.CreatedAt)
		s.containers[c.ID] = c
		return &events.ContainerCreate{ID: c.ID, Image: c.Image, Runtime: &events.ContainerCreate_Runtime{Name: c.Runtime}}, nil
	})
}

// UpdateContainer replaces the record of c.ID but its CreatedAt.
func (n Namespace) UpdateContainer(c Container) *types.Envelope {
	return n.change(func(s *nsState, now time.Time) (proto.Message, error) {
		old, ok := s.containers[c.ID]
		if !ok {
			return nil, fmt.Errorf("no container %q", c.ID)
		}
		c.CreatedAt, c.UpdatedAt, c.Labels = old.CreatedAt, or(c.UpdatedAt, now), maps.Clone(c.Labels)
		s.containers[c.ID] = c
		return &events.ContainerUpdate{ID: c.ID, Image: c.Image, Labels: c.Labels}, nil
	})
}

// DeleteContainer removes container id's record. As containerd does, it
// leaves its task: Tasks.List still lists it, Tasks.Get answers NotFound.
func (n Namespace) DeleteContainer(id string) *types.Envelope {
	return n.change(func(s *nsState, _ time.Time) (proto.Message, error) {
		if _, ok := s.containers[id]; !ok {
			return nil, fmt.Errorf("no container %q", id)
		}
		delete(s.containers, id)
		return &events.ContainerDelete{ID: id}, nil
	})
}

// CreateTask creates container id's task, not started, its process pid.
func (n Namespace) CreateTask(id string, pid uint32) *types.Envelope {
	return n.change(func(s *nsState, _ time.Time) (proto.Message, error) {
		if _, ok := s.containers[id]; !ok {
			return nil, fmt.Errorf("no container %q", id)
		} else if _, ok := s.procs[procKey{id, ""}]; ok {
			return nil, fmt.Errorf("container %q has a task", id)
		}
		s.procs[procKey{id, ""}] = Process{ID: id, Pid: pid, Status: task.Status_CREATED}
		bundle := "/run/containerd/io.containerd.runtime.v2.task/" + n.name + "/" + id
		return &events.TaskCreate{ContainerID: id, Bundle: bundle, IO: &events.TaskIO{}, Pid: pid}, nil
	})
}

// StartTask starts container id's created task.
func (n Namespace) StartTask(id string) *types.Envelope {
	return n.process(id, "", task.Status_CREATED, task.Status_RUNNING, func(p *Process, _ time.Time) proto.Message {
		return &events.TaskStart{ContainerID: id, Pid: p.Pid}
	})
}

// PauseTask pauses container id's running task.
func (n Namespace) PauseTask(id string) *types.Envelope {
	return n.process(id, "", task.Status_RUNNING, task.Status_PAUSED, func(*Process, time.Time) proto.Message {
		return &events.TaskPaused{ContainerID: id}
	})
}

// ResumeTask resumes container id's paused task.
func (n Namespace) ResumeTask(id string) *types.Envelope {
	return n.process(id, "", task.Status_PAUSED, task.Status_RUNNING, func(*Process, time.Time) proto.Message {
		return &events.TaskResumed{ContainerID: id}
	})
}

// OOM reports container id's task out of memory, which changes no record.
func (n Namespace) OOM(id string) *types.Envelope {
	return n.process(id, "", anyLive, anyLive, func(*Process, time.Time) proto.Message {
		return &events.TaskOOM{ContainerID: id}
	})
}

// ExitTask records the exit of container id's task with status. Its execs
// are left running: exit them first, as the shim reports them first.
func (n Namespace) ExitTask(id string, status uint32) *types.Envelope {
	return n.exit(id, "", status, status)
}

// ExitTaskReporting records the exit of container id's task with status
// but publishes a TaskExit saying reported, as containerd 1.6 can around a
// restart (137, 255); Tasks.Get, List and Wait give the real status.
func (n Namespace) ExitTaskReporting(id string, status, reported uint32) *types.Envelope {
	return n.exit(id, "", status, reported)
}

// DeleteTask deletes container id's stopped task, and its execs.
func (n Namespace) DeleteTask(id string) *types.Envelope {
	return n.change(func(s *nsState, _ time.Time) (proto.Message, error) {
		p, ok := s.procs[procKey{id, ""}]
		if !ok || p.Status != task.Status_STOPPED {
			return nil, fmt.Errorf("container %q has no stopped task", id)
		}
		maps.DeleteFunc(s.procs, func(k procKey, _ Process) bool { return k.container == id })
		return &events.TaskDelete{ContainerID: id, Pid: p.Pid, ExitStatus: p.ExitStatus, ExitedAt: timestamppb.New(p.ExitedAt)}, nil
	})
}

// AddExec adds exec process execID, not started, to container id's task.
func (n Namespace) AddExec(id, execID string) *types.Envelope {
	return n.change(func(s *nsState, _ time.Time) (proto.Message, error) {
		p, ok := s.procs[procKey{id, ""}]
		if _, dup := s.procs[procKey{id, execID}]; !ok || p.Status == task.Status_STOPPED || dup {
			return nil, fmt.Errorf("cannot add exec %q to task %q", execID, id)
		}
		s.procs[procKey{id, execID}] = Process{ID: execID, Status: task.Status_CREATED}
		return &events.TaskExecAdded{ContainerID: id, ExecID: execID}, nil
	})
}

// StartExec starts exec process execID of container id's task, as pid.
func (n Namespace) StartExec(id, execID string, pid uint32) *types.Envelope {
	return n.process(id, execID, task.Status_CREATED, task.Status_RUNNING, func(p *Process, _ time.Time) proto.Message {
		p.Pid = pid
		return &events.TaskExecStarted{ContainerID: id, ExecID: execID, Pid: pid}
	})
}

// ExitExec records the exit of exec process execID of container id's task.
func (n Namespace) ExitExec(id, execID string, status uint32) *types.Envelope {
	return n.exit(id, execID, status, status)
}

func (n Namespace) exit(id, execID string, status, reported uint32) *types.Envelope {
	return n.process(id, execID, anyLive, task.Status_STOPPED, func(p *Process, now time.Time) proto.Message {
		p.ExitStatus, p.ExitedAt = status, now
		return &events.TaskExit{ContainerID: id, ID: p.ID, Pid: p.Pid, ExitStatus: reported, ExitedAt: timestamppb.New(now)}
	})
}

// anyLive, as process's from, is any status but stopped; as its to, the
// status the process has.
const anyLive task.Status = -1

// process changes process execID of container id's task, which must have
// status from, to status to, by event, which returns what to publish.
func (n Namespace) process(id, execID string, from, to task.Status, event func(*Process, time.Time) proto.Message) *types.Envelope {
	return n.change(func(s *nsState, now time.Time) (proto.Message, error) {
		k := procKey{id, execID}
		p, ok := s.procs[k]
		if !ok || from == anyLive && p.Status == task.Status_STOPPED || from != anyLive && p.Status != from {
			return nil, fmt.Errorf("process %q of task %q (status %v) cannot become %v", execID, id, p.Status, to)
		}
		ev := event(&p, now)
		if to != anyLive {
			p.Status = to
		}
		s.procs[k] = p
		return ev, nil
	})
}

// CreateImage records img, timestamped now unless it says otherwise.
func (n Namespace) CreateImage(img Image) *types.Envelope {
	return n.change(func(s *nsState, now time.Time) (proto.Message, error) {
		if _, ok := s.images[img.Name]; ok {
			return nil, fmt.Errorf("image %q exists", img.Name)
		}
		img.CreatedAt, img.Labels = or(img.CreatedAt, now), maps.Clone(img.Labels)
		img.UpdatedAt = or(img.UpdatedAt, img.CreatedAt)
		s.images[img.Name] = img
		return &events.ImageCreate{Name: img.Name, Labels: img.Labels}, nil
	})
}

// UpdateImage replaces the record of img.Name but its CreatedAt.
func (n Namespace) UpdateImage(img Image) *types.Envelope {
	return n.change(func(s *nsState, now time.Time) (proto.Message, error) {
		old, ok := s.images[img.Name]
		if !ok {
			return nil, fmt.Errorf("no image %q", img.Name)
		}
		img.CreatedAt, img.UpdatedAt, img.Labels = old.CreatedAt, or(img.UpdatedAt, now), maps.Clone(img.Labels)
		s.images[img.Name] = img
		return &events.ImageUpdate{Name: img.Name, Labels: img.Labels}, nil
	})
}

// DeleteImage removes image name's record.
func (n Namespace) DeleteImage(name string) *types.Envelope {
	return n.change(func(s *nsState, _ time.Time) (proto.Message, error) {
		if _, ok := s.images[name]; !ok {
			return nil, fmt.Errorf("no image %q", name)
		}
		delete(s.images, name)
		return &events.ImageDelete{Name: name}, nil
	})
}

// Publish publishes event, one of containerd's event types, on its topic,
// changing nothing: an event the records do not bear out.
func (n Namespace) Publish(event proto.Message) *types.Envelope {
	return n.change(func(*nsState, time.Time) (proto.Message, error) { return event, nil })
}

// Container returns container id's live record.
func (n Namespace) Container(id string) (c Container, ok bool) {
	n.f.locked(func() { c, ok = n.f.state(n.name, true).containers[id] })
	c.Labels = maps.Clone(c.Labels)
	return c, ok
}

// Task returns the live record of container id's task, its init process.
func (n Namespace) Task(id string) (p Process, ok bool) {
	n.f.locked(func() { p, ok = n.f.state(n.name, true).procs[procKey{id, ""}] })
	return p, ok
}

// Image returns image name's live record.
func (n Namespace) Image(name string) (img Image, ok bool) {
	n.f.locked(func() { img, ok = n.f.state(n.name, true).images[name] })
	img.Labels = maps.Clone(img.Labels)
	return img, ok
}

func or(t, otherwise time.Time) time.Time {
	if t.IsZero() {
		return otherwise
	}
	return t
}

// topics are the topics containerd publishes its events on, by type name.
var topics = map[string]string{
	"ContainerCreate": "/containers/create", "ContainerUpdate": "/containers/update", "ContainerDelete": "/containers/delete",
	"TaskCreate": "/tasks/create", "TaskStart": "/tasks/start", "TaskExit": "/tasks/exit", "TaskDelete": "/tasks/delete",
	"TaskOOM": "/tasks/oom", "TaskPaused": "/tasks/paused", "TaskResumed": "/tasks/resumed",
	"TaskExecAdded": "/tasks/exec-added", "TaskExecStarted": "/tasks/exec-started", "TaskCheckpointed": "/tasks/checkpointed",
	"ImageCreate": "/images/create", "ImageUpdate": "/images/update", "ImageDelete": "/images/delete",
}
