package fakecontainerd_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/containerd/containerd/api/events"
	containersapi "github.com/containerd/containerd/api/services/containers/v1"
	eventsapi "github.com/containerd/containerd/api/services/events/v1"
	imagesapi "github.com/containerd/containerd/api/services/images/v1"
	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	"github.com/containerd/containerd/api/types"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/typeurl/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor/containerd/internal/fakecontainerd"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var t0 = time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC)

func withNS(ctx context.Context, ns string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "containerd-namespace", ns)
}

// subscribe opens a stream and waits until the fake has registered it, so
// that what the test publishes next reaches it.
func subscribe(t *testing.T, f *fakecontainerd.Fake, filters ...string) eventsapi.Events_SubscribeClient {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	before := f.Calls(fakecontainerd.EventsSubscribe)
	stream, err := eventsapi.NewEventsClient(f.Conn()).Subscribe(ctx, &eventsapi.SubscribeRequest{Filters: filters})
	require.NoError(t, err)
	wait, stop := context.WithTimeout(ctx, 10*time.Second)
	defer stop()
	require.NoError(t, f.WaitSubscribers(wait, 1))
	require.Equal(t, before+1, f.Calls(fakecontainerd.EventsSubscribe))
	return stream
}

func topics(t *testing.T, stream eventsapi.Events_SubscribeClient, n int) []string {
	t.Helper()
	var out []string
	for range n {
		env, err := stream.Recv()
		require.NoError(t, err)
		out = append(out, env.GetNamespace()+" "+env.GetTopic())
	}
	return out
}

func decode[T any](t *testing.T, env *types.Envelope) T {
	t.Helper()
	v, err := typeurl.UnmarshalAny(env.GetEvent())
	require.NoError(t, err)
	require.IsType(t, *new(T), v)
	return v.(T)
}

func TestLifecycle(t *testing.T) {
	clk := testingclock.NewFakePassiveClock(t0)
	f := fakecontainerd.New(t, fakecontainerd.WithClock(clk))
	stream := subscribe(t, f)
	ns := f.Namespace("k8s.io")

	ns.CreateContainer(fakecontainerd.Container{ID: "c1", Image: "busybox", Runtime: "io.containerd.runc.v2", Labels: map[string]string{"app": "x"}})
	ns.CreateTask("c1", 42)
	ns.StartTask("c1")
	clk.SetTime(t0.Add(time.Minute))
	ns.ExitTask("c1", 3)
	ns.DeleteTask("c1")
	ns.DeleteContainer("c1")

	var got []*types.Envelope
	for range 6 {
		env, err := stream.Recv()
		require.NoError(t, err)
		got = append(got, env)
	}
	for i, topic := range []string{"/containers/create", "/tasks/create", "/tasks/start", "/tasks/exit", "/tasks/delete", "/containers/delete"} {
		assert.Equal(t, topic, got[i].GetTopic())
		assert.Equal(t, "k8s.io", got[i].GetNamespace())
	}
	assert.Equal(t, t0, got[0].GetTimestamp().AsTime())
	cc := decode[*events.ContainerCreate](t, got[0])
	assert.Equal(t, "busybox", cc.Image)
	assert.Equal(t, "io.containerd.runc.v2", cc.Runtime.GetName())
	exit := decode[*events.TaskExit](t, got[3])
	assert.Equal(t, []any{"c1", "c1", uint32(42), uint32(3), t0.Add(time.Minute)},
		[]any{exit.ContainerID, exit.ID, exit.Pid, exit.ExitStatus, exit.ExitedAt.AsTime()})
	del := decode[*events.TaskDelete](t, got[4])
	assert.Equal(t, []any{"c1", uint32(42), uint32(3), t0.Add(time.Minute)},
		[]any{del.ContainerID, del.Pid, del.ExitStatus, del.ExitedAt.AsTime()})
}

func TestState(t *testing.T) {
	f := fakecontainerd.New(t, fakecontainerd.WithClock(testingclock.NewFakePassiveClock(t0)))
	ns := f.Namespace("default")
	ns.CreateContainer(fakecontainerd.Container{ID: "b", Labels: map[string]string{"role": "db"}})
	ns.CreateContainer(fakecontainerd.Container{ID: "a"})
	ns.CreateTask("a", 7)
	ns.StartTask("a")
	ns.CreateImage(fakecontainerd.Image{Name: "docker.io/library/busybox:latest", Target: fakecontainerd.Descriptor{Digest: "sha256:abc", Size: 10}})
	ctx := withNS(context.Background(), "default")

	cs, err := containersapi.NewContainersClient(f.Conn()).List(ctx, &containersapi.ListContainersRequest{Filters: []string{"labels.role==db"}})
	require.NoError(t, err)
	require.Len(t, cs.Containers, 1)
	assert.Equal(t, "b", cs.Containers[0].ID)
	assert.Equal(t, t0, cs.Containers[0].CreatedAt.AsTime())

	ts, err := tasksapi.NewTasksClient(f.Conn()).List(ctx, &tasksapi.ListTasksRequest{})
	require.NoError(t, err)
	require.Len(t, ts.Tasks, 1)
	// As containerd's: only ID names the container, and a live process
	// has a zero exit time.
	assert.Equal(t, []any{"a", "", uint32(7), task.Status_RUNNING, time.Time{}},
		[]any{ts.Tasks[0].ID, ts.Tasks[0].ContainerID, ts.Tasks[0].Pid, ts.Tasks[0].Status, ts.Tasks[0].ExitedAt.AsTime()})

	img, err := imagesapi.NewImagesClient(f.Conn()).Get(ctx, &imagesapi.GetImageRequest{Name: "docker.io/library/busybox:latest"})
	require.NoError(t, err)
	assert.Equal(t, "sha256:abc", img.Image.Target.Digest)

	_, err = tasksapi.NewTasksClient(f.Conn()).Kill(ctx, &tasksapi.KillRequest{ContainerID: "a"})
	assert.Equal(t, codes.Unimplemented, status.Code(err))
}

func TestNamespaces(t *testing.T) {
	f := fakecontainerd.New(t)
	f.Namespace("a").CreateContainer(fakecontainerd.Container{ID: "c1"})
	f.Namespace("a").CreateTask("c1", 1)
	f.Namespace("a").CreateContainer(fakecontainerd.Container{ID: "c2"})
	containers := containersapi.NewContainersClient(f.Conn())
	tasks := tasksapi.NewTasksClient(f.Conn())
	bg := context.Background()

	_, err := containers.List(bg, &containersapi.ListContainersRequest{})
	assert.Equal(t, codes.FailedPrecondition, status.Code(err), "no namespace")
	_, err = tasks.Get(withNS(bg, "not/valid"), &tasksapi.GetRequest{ContainerID: "c1"})
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
	_, err = eventsapi.NewEventsClient(f.Conn()).Publish(bg, &eventsapi.PublishRequest{Topic: "/x"})
	assert.Equal(t, codes.FailedPrecondition, status.Code(err))

	other, err := containers.List(withNS(bg, "b"), &containersapi.ListContainersRequest{})
	require.NoError(t, err)
	assert.Empty(t, other.Containers)
	_, err = containers.Get(withNS(bg, "b"), &containersapi.GetContainerRequest{ID: "c1"})
	assert.Equal(t, codes.NotFound, status.Code(err))
	_, err = tasks.Get(withNS(bg, "a"), &tasksapi.GetRequest{ContainerID: "c2"})
	assert.Equal(t, codes.NotFound, status.Code(err), "container without a task")
	_, err = tasks.Wait(withNS(bg, "a"), &tasksapi.WaitRequest{ContainerID: "c2"})
	assert.Equal(t, codes.NotFound, status.Code(err), "waiting for no task")
	got, err := tasks.Get(withNS(bg, "a"), &tasksapi.GetRequest{ContainerID: "c1"})
	require.NoError(t, err)
	assert.Equal(t, task.Status_CREATED, got.Process.Status)
}

func TestFilters(t *testing.T) {
	f := fakecontainerd.New(t)
	// No namespace header: a subscription sees every namespace.
	stream := subscribe(t, f, `namespace==a,topic~="/tasks/"`, `topic=="/images/create"`, `event.container_id==c9`)
	a, b := f.Namespace("a"), f.Namespace("b")
	a.Publish(&events.TaskOOM{ContainerID: "c1"})
	b.Publish(&events.TaskOOM{ContainerID: "c1"})    // wrong namespace
	a.Publish(&events.ContainerDelete{ID: "c1"})     // wrong topic
	b.Publish(&events.ImageCreate{Name: "img"})      // second filter
	b.Publish(&events.TaskExit{ContainerID: "c9"})   // third filter
	a.Publish(&events.TaskPaused{ContainerID: "c1"}) // first filter again
	assert.Equal(t, []string{"a /tasks/oom", "b /images/create", "b /tasks/exit", "a /tasks/paused"}, topics(t, stream, 4))

	bad, err := eventsapi.NewEventsClient(f.Conn()).Subscribe(context.Background(), &eventsapi.SubscribeRequest{Filters: []string{"topic=="}})
	require.NoError(t, err)
	_, err = bad.Recv()
	assert.Equal(t, codes.Unknown, status.Code(err), "containerd gives a bad filter no code")
}

func TestQuietDeliverAndWrongExit(t *testing.T) {
	f := fakecontainerd.New(t)
	stream := subscribe(t, f, `topic~="/tasks/"`)
	ns := f.Namespace("k8s.io")
	ns.Quiet().CreateContainer(fakecontainerd.Container{ID: "c1"})
	ns.CreateTask("c1", 5)
	ns.StartTask("c1")
	exit := ns.Quiet().ExitTaskReporting("c1", 0, 137)
	del := ns.Quiet().DeleteTask("c1")
	ns.Publish(&events.TaskOOM{ContainerID: "c1"}) // no change: the task is gone
	f.Deliver(del, exit, exit)
	assert.Equal(t, []string{"k8s.io /tasks/create", "k8s.io /tasks/start", "k8s.io /tasks/oom",
		"k8s.io /tasks/delete", "k8s.io /tasks/exit", "k8s.io /tasks/exit"}, topics(t, stream, 6))
	assert.Equal(t, uint32(137), decode[*events.TaskExit](t, exit).ExitStatus)
	_, ok := ns.Task("c1")
	assert.False(t, ok)
}

func TestWaitAndWrongExit(t *testing.T) {
	f := fakecontainerd.New(t)
	ns := f.Namespace("default")
	ns.CreateContainer(fakecontainerd.Container{ID: "c1"})
	ns.CreateTask("c1", 5)
	ns.StartTask("c1")
	ctx := withNS(context.Background(), "default")
	tasks := tasksapi.NewTasksClient(f.Conn())

	done := make(chan *tasksapi.WaitResponse, 1)
	go func() {
		resp, err := tasks.Wait(ctx, &tasksapi.WaitRequest{ContainerID: "c1"})
		assert.NoError(t, err)
		done <- resp
	}()
	require.Eventually(t, func() bool { return f.Calls(fakecontainerd.TasksWait) == 1 }, 10*time.Second, time.Millisecond)
	env := ns.ExitTaskReporting("c1", 2, 255)
	assert.Equal(t, uint32(255), decode[*events.TaskExit](t, env).ExitStatus)
	assert.Equal(t, uint32(2), (<-done).ExitStatus)
	got, err := tasks.Get(ctx, &tasksapi.GetRequest{ContainerID: "c1"})
	require.NoError(t, err)
	assert.Equal(t, []any{uint32(2), task.Status_STOPPED}, []any{got.Process.ExitStatus, got.Process.Status})
	assert.Equal(t, 1, f.Calls(fakecontainerd.TasksGet))
}

func TestOutage(t *testing.T) {
	f := fakecontainerd.New(t)
	ns := f.Namespace("default")
	ns.CreateContainer(fakecontainerd.Container{ID: "c1"})
	ns.CreateTask("c1", 5)
	stream := subscribe(t, f)
	ctx := withNS(context.Background(), "default")
	tasks := tasksapi.NewTasksClient(f.Conn())
	waited := make(chan error, 1)
	go func() {
		_, err := tasks.Wait(ctx, &tasksapi.WaitRequest{ContainerID: "c1"})
		waited <- err
	}()
	require.Eventually(t, func() bool { return f.Calls(fakecontainerd.TasksWait) == 1 }, 10*time.Second, time.Millisecond)

	f.Down()
	_, err := stream.Recv()
	assert.Equal(t, codes.Unavailable, status.Code(err), "stream")
	assert.Equal(t, codes.Unavailable, status.Code(<-waited), "wait")
	_, err = tasks.List(ctx, &tasksapi.ListTasksRequest{})
	assert.Equal(t, codes.Unavailable, status.Code(err), "call")
	ns.StartTask("c1") // lost: nobody can be subscribed
	ns.ExitTask("c1", 1)

	f.Up()
	stream = subscribe(t, f)
	ns.DeleteTask("c1")
	assert.Equal(t, []string{"default /tasks/delete"}, topics(t, stream, 1))
	assert.Equal(t, 2, f.Calls(fakecontainerd.EventsSubscribe))
	assert.Equal(t, 1, f.Calls(fakecontainerd.TasksList))
}

func TestListHookAndSnapshot(t *testing.T) {
	f := fakecontainerd.New(t)
	ns := f.Namespace("default")
	ns.CreateContainer(fakecontainerd.Container{ID: "c1"})
	ns.CreateTask("c1", 5)
	ns.StartTask("c1")
	stream := subscribe(t, f)
	ctx := withNS(context.Background(), "default")
	containers := containersapi.NewContainersClient(f.Conn())
	tasks := tasksapi.NewTasksClient(f.Conn())

	// Between the container listing and the task listing, c1 exits and c2
	// appears: the first listing has c1 only, the second no task.
	f.OnCall(fakecontainerd.ContainersList, func(call int) {
		if call == 1 {
			ns.ExitTask("c1", 0)
			ns.DeleteTask("c1")
			ns.CreateContainer(fakecontainerd.Container{ID: "c2"})
		}
	})
	cs, err := containers.List(ctx, &containersapi.ListContainersRequest{})
	require.NoError(t, err)
	require.Len(t, cs.Containers, 1)
	ts, err := tasks.List(ctx, &tasksapi.ListTasksRequest{})
	require.NoError(t, err)
	assert.Empty(t, ts.Tasks)
	assert.Equal(t, []string{"default /tasks/exit", "default /tasks/delete", "default /containers/create"}, topics(t, stream, 3))

	snap := f.Snapshot()
	ns.DeleteContainer("c2")
	f.ServeSnapshot(snap)
	cs, err = containers.List(ctx, &containersapi.ListContainersRequest{})
	require.NoError(t, err)
	assert.Len(t, cs.Containers, 2, "stale listing")
	f.ServeSnapshot(nil)
	cs, err = containers.List(ctx, &containersapi.ListContainersRequest{})
	require.NoError(t, err)
	assert.Len(t, cs.Containers, 1)
	assert.Equal(t, 3, f.Calls(fakecontainerd.ContainersList))
}

func TestExecsAndVariants(t *testing.T) {
	f := fakecontainerd.New(t, fakecontainerd.WithTaskContainerID())
	stream := subscribe(t, f, `topic~=/tasks/`, `topic~=^/containers/`, `topic=="/custom"`)
	ns := f.Namespace("default")
	ns.CreateContainer(fakecontainerd.Container{ID: "c1"})
	ns.UpdateContainer(fakecontainerd.Container{ID: "c1", Labels: map[string]string{"a": "b"}})
	ns.CreateTask("c1", 5)
	ns.StartTask("c1")
	ns.PauseTask("c1")
	ns.ResumeTask("c1")
	ns.AddExec("c1", "e1")
	ns.StartExec("c1", "e1", 6)
	ns.ExitExec("c1", "e1", 4)
	ctx := withNS(context.Background(), "default")
	oom, err := typeurl.MarshalAny(&events.TaskOOM{ContainerID: "c1"})
	require.NoError(t, err)
	_, err = eventsapi.NewEventsClient(f.Conn()).Publish(ctx, &eventsapi.PublishRequest{Topic: "/custom", Event: typeurl.MarshalProto(oom)})
	require.NoError(t, err)
	assert.Equal(t, []string{"default /containers/create", "default /containers/update", "default /tasks/create",
		"default /tasks/start", "default /tasks/paused", "default /tasks/resumed", "default /tasks/exec-added",
		"default /tasks/exec-started", "default /tasks/exit", "default /custom"}, topics(t, stream, 10))

	got, err := tasksapi.NewTasksClient(f.Conn()).Get(ctx, &tasksapi.GetRequest{ContainerID: "c1", ExecID: "e1"})
	require.NoError(t, err)
	assert.Equal(t, []any{"c1", "e1", uint32(6), task.Status_STOPPED, uint32(4)},
		[]any{got.Process.ContainerID, got.Process.ID, got.Process.Pid, got.Process.Status, got.Process.ExitStatus})
	list, err := containersapi.NewContainersClient(f.Conn()).ListStream(ctx, &containersapi.ListContainersRequest{})
	require.NoError(t, err)
	msg, err := list.Recv()
	require.NoError(t, err)
	assert.Equal(t, map[string]string{"a": "b"}, msg.Container.Labels)
}

// errorRecorder records the errors the fake reports instead of failing.
type errorRecorder struct {
	testing.TB
	errs []string
}

func (r *errorRecorder) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

func TestImpossibleChange(t *testing.T) {
	r := &errorRecorder{TB: t}
	ns := fakecontainerd.New(r).Namespace("default")
	ns.CreateContainer(fakecontainerd.Container{ID: "c1"})
	ns.CreateTask("c1", 5)
	assert.Nil(t, ns.PauseTask("c1"), "a created task cannot pause")
	assert.Nil(t, ns.DeleteTask("c1"), "nor be deleted")
	p, _ := ns.Task("c1")
	assert.Equal(t, task.Status_CREATED, p.Status)
	assert.Len(t, r.errs, 2)
}
