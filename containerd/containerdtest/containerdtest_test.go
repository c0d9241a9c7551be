package containerdtest_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/api/events"
	eventsapi "github.com/containerd/containerd/api/services/events/v1"
	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	tasktypes "github.com/containerd/containerd/api/types/task"
	"github.com/containerd/typeurl/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/eventmonitor/eventmonitor/containerd/containerdtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func dial(t *testing.T, d *containerdtest.Daemon) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+d.Address(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return conn
}

func inNamespace(ns string) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	return metadata.AppendToOutgoingContext(ctx, "containerd-namespace", ns), cancel
}

// process is what the daemon says of a task's process (exec "" is the
// init process), or nil if it has no such task.
func process(t *testing.T, conn *grpc.ClientConn, ns, id, exec string) *tasktypes.Process {
	t.Helper()
	ctx, cancel := inNamespace(ns)
	defer cancel()
	resp, err := tasksapi.NewTasksClient(conn).Get(ctx, &tasksapi.GetRequest{ContainerID: id, ExecID: exec})
	if err != nil && strings.Contains(err.Error(), "not found") {
		return nil
	}
	require.NoError(t, err)
	return resp.GetProcess()
}

// waitStatus waits until the process has status want, and returns it.
func waitStatus(t *testing.T, conn *grpc.ClientConn, ns, id, exec string, want tasktypes.Status) *tasktypes.Process {
	t.Helper()
	var p *tasktypes.Process
	require.Eventually(t, func() bool {
		p = process(t, conn, ns, id, exec)
		return p.GetStatus() == want
	}, 30*time.Second, 10*time.Millisecond, "waiting for %s/%s %q to be %v (is %v)", ns, id, exec, want, p.GetStatus())
	return p
}

// recorder subscribes to the daemon's events; a handshake makes sure the
// subscription is live before the test goes on.
type recorder struct {
	mu     sync.Mutex
	events []any
}

func record(t *testing.T, conn *grpc.ClientConn) *recorder {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := eventsapi.NewEventsClient(conn).Subscribe(ctx, &eventsapi.SubscribeRequest{})
	require.NoError(t, err)
	r, done := &recorder{}, make(chan struct{})
	go func() {
		defer close(done)
		for {
			env, err := stream.Recv()
			if err != nil {
				return
			}
			if e, err := typeurl.UnmarshalAny(env.GetEvent()); err == nil {
				r.mu.Lock()
				r.events = append(r.events, e)
				r.mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done })

	// The daemon registers a subscriber a moment after Subscribe returns.
	probe := fmt.Sprint("probe-", time.Now().UnixNano())
	payload, err := typeurl.MarshalAnyToProto(&events.NamespaceUpdate{Name: probe})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		ctx, cancel := inNamespace("default")
		defer cancel()
		if _, err := eventsapi.NewEventsClient(conn).Publish(ctx, &eventsapi.PublishRequest{Topic: "/containerdtest/probe", Event: payload}); err != nil {
			return false
		}
		return slices.ContainsFunc(r.all(), func(e any) bool {
			u, ok := e.(*events.NamespaceUpdate)
			return ok && u.Name == probe
		})
	}, 10*time.Second, 20*time.Millisecond)
	return r
}

func (r *recorder) all() []any {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.events)
}

func TestStopKillRestartKeepState(t *testing.T) {
	t.Parallel()
	d := containerdtest.Start(t)
	require.Less(t, len(d.Address()), 100, "a unix socket path must be short")
	version, err := d.Version()
	require.NoError(t, err)
	t.Logf("containerd %s", version)
	_, err = d.Ctr("namespaces", "create", "cdt-state")
	require.NoError(t, err)

	d.Stop()
	_, err = d.Ctr("--connect-timeout", "100ms", "version")
	assert.Error(t, err, "the daemon is down")
	require.NoError(t, d.Restart())
	assert.Error(t, d.Restart(), "already running")

	d.Kill()
	_, err = d.Ctr("--connect-timeout", "100ms", "version")
	assert.Error(t, err, "the daemon is down")
	require.NoError(t, d.Restart())
	out, err := d.Ctr("namespaces", "ls", "-q")
	require.NoError(t, err)
	assert.Contains(t, strings.Fields(out), "cdt-state", "the state outlives restarts")
	assert.Equal(t, 3, strings.Count(d.Log(), "containerdtest: starting the daemon"), "the log spans every start")
}

// TestContainers runs the test program every way it can run: exiting at
// once, after a release, as an exec, and until it is OOM-killed.
func TestContainers(t *testing.T) {
	t.Parallel()
	d := containerdtest.Start(t, containerdtest.Isolated())
	conn := dial(t, d)
	rec := record(t, conn)
	const ns = "cdt-containers"

	require.NoError(t, d.Run(ns, "exit0", containerdtest.Process{}))
	require.NoError(t, d.Run(ns, "exit3", containerdtest.Process{ExitCode: 3, Release: "exit3"}, "--label", "purpose=test"))
	assert.Equal(t, uint32(0), waitStatus(t, conn, ns, "exit0", "", tasktypes.Status_STOPPED).GetExitStatus())

	waitStatus(t, conn, ns, "exit3", "", tasktypes.Status_RUNNING)
	require.NoError(t, d.Exec(ns, "exit3", "exec5", containerdtest.Process{ExitCode: 5}))
	assert.Equal(t, uint32(5), waitStatus(t, conn, ns, "exit3", "exec5", tasktypes.Status_STOPPED).GetExitStatus())
	assert.Equal(t, tasktypes.Status_RUNNING, process(t, conn, ns, "exit3", "").GetStatus(), "still waiting for its release")
	require.NoError(t, d.Release("exit3"))
	assert.Equal(t, uint32(3), waitStatus(t, conn, ns, "exit3", "", tasktypes.Status_STOPPED).GetExitStatus())

	require.NoError(t, d.Run(ns, "oom", containerdtest.Process{OOM: true}, "--memory-limit", "33554432"))
	assert.Equal(t, uint32(137), waitStatus(t, conn, ns, "oom", "", tasktypes.Status_STOPPED).GetExitStatus(), "SIGKILLed")
	require.Eventually(t, func() bool {
		return slices.ContainsFunc(rec.all(), func(e any) bool {
			oom, ok := e.(*events.TaskOOM)
			return ok && oom.ContainerID == "oom"
		})
	}, 10*time.Second, 10*time.Millisecond, "a TaskOOM for the container")

	// The daemon may answer STOPPED before its TaskExit has come.
	want := []string{"exit0/exit0 0", "exit3/exec5 5", "exit3/exit3 3", "oom/oom 137"}
	var exits []string
	if !assert.Eventually(t, func() bool {
		exits = nil
		for _, e := range rec.all() {
			if e, ok := e.(*events.TaskExit); ok {
				exits = append(exits, fmt.Sprintf("%s/%s %d", e.ContainerID, e.ID, e.ExitStatus))
			}
		}
		return len(exits) >= len(want)
	}, 10*time.Second, 10*time.Millisecond) {
		t.Logf("the events: %v", rec.all())
	}
	assert.ElementsMatch(t, want, exits)

	pid, err := d.ShimPid(ns, "exit3")
	require.NoError(t, err)
	assert.Positive(t, pid)
	_, err = d.ShimPid(ns, "no-such-container")
	assert.Error(t, err)
}

func TestImages(t *testing.T) {
	t.Parallel()
	d := containerdtest.Start(t, containerdtest.Isolated())
	conn := dial(t, d)
	const ns, ref, tag = "cdt-images", "docker.io/library/cdt:1", "docker.io/library/cdt:2"

	require.NoError(t, d.ImportImage(ns, ref))
	require.NoError(t, d.TagImage(ns, ref, tag))
	out, err := d.Ctr("-n", ns, "images", "ls", "-q")
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{ref, tag}, strings.Fields(out))

	require.NoError(t, d.RunImage(ns, tag, "from-image", containerdtest.Process{ExitCode: 7, Release: "from-image"}))
	waitStatus(t, conn, ns, "from-image", "", tasktypes.Status_RUNNING)
	require.NoError(t, d.Release("from-image"))
	assert.Equal(t, uint32(7), waitStatus(t, conn, ns, "from-image", "", tasktypes.Status_STOPPED).GetExitStatus())

	require.NoError(t, d.RemoveImage(ns, ref))
	out, err = d.Ctr("-n", ns, "images", "ls", "-q")
	require.NoError(t, err)
	assert.Equal(t, []string{tag}, strings.Fields(out))
}

// TestRemoveLeavesNothing leaves a daemon, killed, with a running, a
// paused and a stopped container, one whose shim was killed, and one run
// with ctr itself, whose cgroup is where runc puts it by default: the
// cleanup ends every process, and removes the cgroups and the directory.
func TestRemoveLeavesNothing(t *testing.T) {
	t.Parallel()
	var (
		d   *containerdtest.Daemon
		ns  = fmt.Sprintf("cdt-remove-%d", os.Getpid())
		ids = []string{"running", "paused", "stopped", "lost"}
	)
	pids := map[string]int{}
	t.Run("leave", func(t *testing.T) {
		d = containerdtest.Start(t, containerdtest.Isolated())
		conn := dial(t, d)
		for _, id := range ids {
			p := containerdtest.Process{Release: id}
			if id == "stopped" {
				p = containerdtest.Process{}
			}
			require.NoError(t, d.Run(ns, id, p))
		}
		rootfs, err := d.Rootfs()
		require.NoError(t, err)
		args := append([]string{"-n", ns, "run", "-d", "--null-io", "--rootfs", rootfs, "direct"},
			containerdtest.Process{Release: "direct"}.Args()...)
		_, err = d.Ctr(args...)
		require.NoError(t, err)
		for _, id := range []string{"running", "paused", "lost", "direct"} {
			pids[id] = int(waitStatus(t, conn, ns, id, "", tasktypes.Status_RUNNING).GetPid())
		}
		waitStatus(t, conn, ns, "stopped", "", tasktypes.Status_STOPPED)
		_, err = d.Ctr("-n", ns, "tasks", "pause", "paused")
		require.NoError(t, err)
		waitStatus(t, conn, ns, "paused", "", tasktypes.Status_PAUSED)
		shim, err := d.ShimPid(ns, "lost")
		require.NoError(t, err)
		pids["shim"] = shim
		d.Kill()
		require.NoError(t, syscall.Kill(shim, syscall.SIGKILL))
	})
	for what, pid := range pids {
		assert.False(t, alive(pid), "%s (pid %d) outlived the test", what, pid)
	}
	// Run's containers' cgroups are under one named after the daemon's
	// directory; runc's default puts them under the namespace's.
	var cgroups []string
	for _, name := range []string{ns, filepath.Base(filepath.Dir(d.Address()))} {
		dirs, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", name))
		cgroups = append(cgroups, dirs...)
		if dir := filepath.Join("/sys/fs/cgroup", name); isDir(dir) {
			cgroups = append(cgroups, dir)
		}
	}
	assert.Empty(t, cgroups, "cgroups left behind")
	assert.NoDirExists(t, filepath.Dir(d.Address()))
}

// alive reports whether pid is a process that has not exited.
func alive(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	return len(fields) > 0 && fields[0] != "Z" && fields[0] != "X"
}

func isDir(path string) bool {
	info, err := os.Stat(path)
	return err == nil && info.IsDir()
}

// fakeT records how Start ends a test that cannot have a daemon.
type fakeT struct {
	testing.TB
	skipped, failed string
}

func (f *fakeT) Helper() {}
func (f *fakeT) Skipf(format string, args ...any) {
	f.skipped = fmt.Sprintf(format, args...)
	runtime.Goexit()
}
func (f *fakeT) Fatalf(format string, args ...any) {
	f.failed = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func startFake(opts ...containerdtest.Option) *fakeT {
	f := &fakeT{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		containerdtest.Start(f, opts...)
	}()
	<-done
	return f
}

// TestMissingContainerd skips, with a hint, when there is no containerd,
// and fails instead when RequireEnv is set.
func TestMissingContainerd(t *testing.T) {
	empty := containerdtest.WithBinDir(t.TempDir())
	t.Setenv("PATH", t.TempDir())

	t.Setenv(containerdtest.RequireEnv, "")
	f := startFake(empty)
	assert.Contains(t, f.skipped, "apt-get install -y containerd")
	assert.Empty(t, f.failed)

	t.Setenv(containerdtest.RequireEnv, "1")
	f = startFake(empty)
	assert.Contains(t, f.failed, containerdtest.RequireEnv+" is set")
	assert.Empty(t, f.skipped)
}

// TestWithBinDir runs a container from a daemon in a directory of its own:
// containerd, ctr and the shim all come from there.
func TestWithBinDir(t *testing.T) {
	t.Parallel()
	bin := t.TempDir()
	used := filepath.Join(bin, "used")
	for _, tool := range []string{"containerd", "ctr", "containerd-shim-runc-v2"} {
		real, err := exec.LookPath(tool)
		if err != nil {
			t.Skipf("%s is not installed", tool)
		}
		script := fmt.Sprintf("#!/bin/sh\necho %s >>%s\nexec %s \"$@\"\n", tool, used, real)
		require.NoError(t, os.WriteFile(filepath.Join(bin, tool), []byte(script), 0o755))
	}
	d := containerdtest.Start(t, containerdtest.WithBinDir(bin), containerdtest.Isolated())
	conn := dial(t, d)
	require.NoError(t, d.Run("cdt-bin", "c", containerdtest.Process{ExitCode: 4}))
	assert.Equal(t, uint32(4), waitStatus(t, conn, "cdt-bin", "c", "", tasktypes.Status_STOPPED).GetExitStatus())
	b, err := os.ReadFile(used)
	require.NoError(t, err)
	for _, tool := range []string{"containerd", "ctr", "containerd-shim-runc-v2"} {
		assert.Contains(t, strings.Fields(string(b)), tool)
	}
}
