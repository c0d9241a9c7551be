package containerd_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/api/events"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
	"github.com/eventmonitor/eventmonitor/containerd/containerdtest"
)

// TestWaitExitGoneInDaemon asks a real daemon for the exit of a task that
// does not exist, of a container with no task and of one that does not
// exist: each is ErrTaskGone, at once.
func TestWaitExitGoneInDaemon(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, false)
	c := dial(t, d)
	d.mustCtr("namespaces", "create", "emtest-gone")
	d.mustCtr("-n", "emtest-gone", "containers", "create", "--rootfs", t.TempDir(), "no-task", "/bin/true")
	t.Cleanup(func() {
		d.Ctr("-n", "emtest-gone", "containers", "delete", "no-task")
		d.Ctr("namespaces", "remove", "emtest-gone")
	})
	for _, tc := range []struct{ ns, id, exec string }{
		{"emtest-gone", "no-task", ""},
		{"emtest-gone", "no-such-container", ""},
		{"emtest-gone", "no-task", "no-such-exec"},
	} {
		s := receive(t, containerd.WaitExit(context.Background(), c.conn, tc.ns, tc.id, tc.exec))
		code, _, err := s.Result()
		assert.ErrorIs(t, err, containerd.ErrTaskGone, "%+v", tc)
		assert.Equal(t, uint32(eventmonitor.UnknownExitCode), code)
	}
}

// TestWaitExitAcrossDaemonRestart kills containerd (SIGKILL) while three
// real containers run, waited on with WaitExit, and starts it again 3 s
// later. Their shims outlive the daemon, and the restarted daemon serves
// the same tasks:
//
//   - "later" exits after the restart, with 42, through WatchExit into a
//     monitor: the handler sees exactly one TaskExit, with 42;
//   - "during" exits during the outage, with 43. containerd 1.6 reloads its
//     shim, which keeps the status, and the wait delivers 43 after the
//     restart. containerd 2.4.2 removes, as it starts, every
//     shim whose task has no process left (shouldCleanupShim, in
//     core/runtime/v2/shim_load.go), so the task is gone and so is its
//     status: the wait delivers ErrTaskGone;
//   - "lost" has its shim and process killed during the outage: the
//     restarted daemon finds the shim dead, cleans up and has no such task,
//     so its wait delivers ErrTaskGone.
//
// During the outage nothing is delivered at all: with containerd's
// task.Wait, each wait would have delivered status 255 at the kill.
func TestWaitExitAcrossDaemonRestart(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, true)
	c := dial(t, d)
	ns := "emtest-wait"
	pids := map[string]int{}
	for _, tc := range []struct {
		id   string
		code int
	}{{"later", 42}, {"during", 43}, {"lost", 44}} {
		require.NoError(t, d.Run(ns, tc.id, containerdtest.Process{ExitCode: tc.code, Release: tc.id}))
	}
	// TASK PID STATUS, after a header.
	for _, line := range strings.Split(d.mustCtr("-n", ns, "task", "ls"), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[1] != "PID" {
			require.Equal(t, "RUNNING", f[2], line)
			pid, err := strconv.Atoi(f[1])
			require.NoError(t, err, line)
			pids[f[0]] = pid
		}
	}
	require.Len(t, pids, 3)

	h := &seen{}
	m, err := eventmonitor.New(h)
	require.NoError(t, err)
	t.Cleanup(m.Stop)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	watched := eventmonitor.WatchExit(ctx, m, "later", containerd.WaitExit(ctx, c.conn, ns, "later", ""),
		containerd.TaskExit("later", "later", uint32(pids["later"])))
	during := containerd.WaitExit(ctx, c.conn, ns, "during", "")
	lost := containerd.WaitExit(ctx, c.conn, ns, "lost", "")

	d.Kill()
	killedAt := time.Now()
	require.NoError(t, d.Release("during"))
	shim, err := d.ShimPid(ns, "lost")
	require.NoError(t, err)
	require.NoError(t, syscall.Kill(shim, syscall.SIGKILL))
	require.NoError(t, syscall.Kill(pids["lost"], syscall.SIGKILL))
	for _, id := range []string{"during", "lost"} {
		waitFor(t, id+"'s process to end", func() bool { return !alive(pids[id]) })
	}
	// The rest of the outage: nothing may be delivered in it.
	const outage = 3 * time.Second
	select {
	case s := <-during:
		t.Fatalf("delivered %+v for a task whose daemon is down", s)
	case s := <-lost:
		t.Fatalf("delivered %+v for a task whose daemon is down", s)
	case <-watched:
		t.Fatalf("handled %v while the daemon was down", h.of("later"))
	case <-time.After(time.Until(killedAt.Add(outage))):
	}

	d.restart()
	back := time.Now()
	s := receive(t, during)
	t.Logf("the exit during the outage was delivered %v after the daemon was back: %+v",
		time.Since(back).Round(time.Millisecond), s)
	code, exitedAt, err := s.Result()
	if d.major() < 2 {
		require.NoError(t, err, "daemon log:\n%s", d.Log())
		assert.Equal(t, uint32(43), code)
		assert.True(t, exitedAt.After(killedAt) && exitedAt.Before(back), "exited at %v, during the outage", exitedAt)
	} else {
		assert.ErrorIs(t, err, containerd.ErrTaskGone, "daemon log:\n%s", d.Log())
	}

	// If the shim's death were not noticed, the daemon would still list the
	// task; it does not, and says so.
	s = receive(t, lost)
	assert.ErrorIs(t, s.Error(), containerd.ErrTaskGone, "daemon log:\n%s", d.Log())

	select {
	case <-watched:
		t.Fatalf("handled %v before the container exited", h.of("later"))
	default:
	}
	require.NoError(t, d.Release("later"))
	select {
	case <-watched:
	case <-time.After(20 * time.Second):
		t.Fatal("the exit after the restart was not handled within 20 s")
	}
	got := h.of("later")
	require.Len(t, got, 1)
	exit := got[0].(*events.TaskExit)
	assert.Equal(t, uint32(42), exit.ExitStatus)
	assert.Equal(t, uint32(pids["later"]), exit.Pid)
}

// alive reports whether pid is a process that has not exited (a zombie
// has).
func alive(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	return len(fields) > 0 && fields[0] != "Z" && fields[0] != "X"
}
