package containerd_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/api/events"
	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
)

// fakeTasks is containerd's Tasks service with a Wait of the test's
// choosing, on a unix socket; every other call is unimplemented.
type fakeTasks struct {
	tasksapi.UnimplementedTasksServer
	socket string

	mu    sync.Mutex
	calls []string // "namespace/container/exec" of each Wait
	wait  func(ctx context.Context, call int) (*tasksapi.WaitResponse, error)
	srv   *grpc.Server
}

func newFakeTasks(t *testing.T, wait func(ctx context.Context, call int) (*tasksapi.WaitResponse, error)) *fakeTasks {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "emw") // a unix socket path must stay short
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	f := &fakeTasks{socket: filepath.Join(dir, "tasks.sock"), wait: wait}
	f.serve(t)
	t.Cleanup(f.stop)
	return f
}

// serve starts (or starts again) serving on the socket.
func (f *fakeTasks) serve(t *testing.T) {
	t.Helper()
	os.Remove(f.socket)
	l, err := net.Listen("unix", f.socket)
	require.NoError(t, err)
	srv := grpc.NewServer()
	tasksapi.RegisterTasksServer(srv, f)
	f.mu.Lock()
	f.srv = srv
	f.mu.Unlock()
	go srv.Serve(l)
}

// stop closes the socket and every connection on it, as a killed daemon does.
func (f *fakeTasks) stop() {
	f.mu.Lock()
	srv := f.srv
	f.mu.Unlock()
	srv.Stop()
}

func (f *fakeTasks) Wait(ctx context.Context, req *tasksapi.WaitRequest) (*tasksapi.WaitResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	f.mu.Lock()
	f.calls = append(f.calls, firstOf(md.Get("containerd-namespace"))+"/"+req.GetContainerID()+"/"+req.GetExecID())
	call := len(f.calls)
	f.mu.Unlock()
	return f.wait(ctx, call)
}

func (f *fakeTasks) callsMade() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

func firstOf(s []string) string {
	if len(s) == 0 {
		return ""
	}
	return s[0]
}

func dialFake(t *testing.T, f *fakeTasks) *grpc.ClientConn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := containerd.Dial(ctx, f.socket)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return conn
}

// receive waits for WaitExit's one value and for its channel to close.
func receive(t *testing.T, ch <-chan containerd.ExitStatus) containerd.ExitStatus {
	t.Helper()
	var s containerd.ExitStatus
	select {
	case got, ok := <-ch:
		require.True(t, ok, "the channel closed without a status")
		s = got
	case <-time.After(20 * time.Second):
		t.Fatal("no exit status within 20 s")
	}
	select {
	case _, ok := <-ch:
		require.False(t, ok, "a second value")
	case <-time.After(5 * time.Second):
		t.Fatal("the channel was not closed after its value")
	}
	return s
}

// requireClosedEmpty waits for ch to close without delivering anything.
func requireClosedEmpty(t *testing.T, ch <-chan containerd.ExitStatus) {
	t.Helper()
	select {
	case s, ok := <-ch:
		require.False(t, ok, "delivered %+v", s)
	case <-time.After(10 * time.Second):
		t.Fatal("the channel was not closed within 10 s")
	}
}

// TestWaitExit pins what WaitExit delivers for each answer of the daemon:
// a status, NotFound as ErrTaskGone, transport errors not at all (it waits
// again), other errors only once they persist, and nothing when ctx ends.
func TestWaitExit(t *testing.T) {
	exitedAt := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	exit := &tasksapi.WaitResponse{ExitStatus: 42, ExitedAt: timestamppb.New(exitedAt)}
	unavailable := status.Error(codes.Unavailable, "error reading from server: EOF")

	t.Run("a real exit", func(t *testing.T) {
		f := newFakeTasks(t, func(context.Context, int) (*tasksapi.WaitResponse, error) { return exit, nil })
		s := receive(t, containerd.WaitExit(context.Background(), dialFake(t, f), "k8s.io", "c1", ""))
		code, at, err := s.Result()
		assert.NoError(t, err)
		assert.Equal(t, uint32(42), code)
		assert.True(t, exitedAt.Equal(at), "exited at %v", at)
		assert.Equal(t, code, s.ExitCode())
		assert.Equal(t, at, s.ExitTime())
		assert.NoError(t, s.Error())
		assert.Equal(t, []string{"k8s.io/c1/"}, f.callsMade(), "namespace in metadata, IDs in the request")
	})

	t.Run("transport errors are waited out", func(t *testing.T) {
		f := newFakeTasks(t, func(_ context.Context, call int) (*tasksapi.WaitResponse, error) {
			switch call {
			case 1, 2:
				return nil, unavailable
			case 3:
				return nil, status.Error(codes.Canceled, "the daemon is shutting down")
			}
			return exit, nil
		})
		s := receive(t, containerd.WaitExit(context.Background(), dialFake(t, f), "k8s.io", "c1", "exec1"))
		code, _, err := s.Result()
		require.NoError(t, err)
		assert.Equal(t, uint32(42), code)
		assert.Equal(t, []string{"k8s.io/c1/exec1", "k8s.io/c1/exec1", "k8s.io/c1/exec1", "k8s.io/c1/exec1"}, f.callsMade())
	})

	t.Run("NotFound is gone", func(t *testing.T) {
		f := newFakeTasks(t, func(context.Context, int) (*tasksapi.WaitResponse, error) {
			return nil, status.Error(codes.NotFound, `container "c1" in namespace "k8s.io": not found`)
		})
		s := receive(t, containerd.WaitExit(context.Background(), dialFake(t, f), "k8s.io", "c1", ""))
		code, at, err := s.Result()
		require.ErrorIs(t, err, containerd.ErrTaskGone)
		assert.Equal(t, codes.NotFound, status.Code(err), "the daemon's own error is kept: %v", err)
		assert.ErrorContains(t, err, `task "c1" in namespace "k8s.io"`)
		assert.Equal(t, uint32(eventmonitor.UnknownExitCode), code)
		assert.True(t, at.IsZero())
		assert.Len(t, f.callsMade(), 1, "gone is final: no second wait")
	})

	t.Run("an unknown error, then gone", func(t *testing.T) {
		// A shim dying under a live daemon: the wait fails with no
		// particular code, and the daemon then removes the task.
		f := newFakeTasks(t, func(_ context.Context, call int) (*tasksapi.WaitResponse, error) {
			if call == 1 {
				return nil, status.Error(codes.Unknown, "ttrpc: closed")
			}
			return nil, status.Error(codes.NotFound, "not found")
		})
		s := receive(t, containerd.WaitExit(context.Background(), dialFake(t, f), "k8s.io", "c1", ""))
		assert.ErrorIs(t, s.Error(), containerd.ErrTaskGone)
		assert.Len(t, f.callsMade(), 2)
	})

	t.Run("a persistent error is delivered", func(t *testing.T) {
		f := newFakeTasks(t, func(context.Context, int) (*tasksapi.WaitResponse, error) {
			return nil, status.Error(codes.PermissionDenied, "no")
		})
		s := receive(t, containerd.WaitExit(context.Background(), dialFake(t, f), "k8s.io", "c1", ""))
		err := s.Error()
		require.Error(t, err)
		assert.NotErrorIs(t, err, containerd.ErrTaskGone)
		assert.Equal(t, codes.PermissionDenied, status.Code(err), "%v", err)
		assert.Equal(t, uint32(eventmonitor.UnknownExitCode), s.ExitCode())
		assert.Len(t, f.callsMade(), 3, "given up after 3 attempts in a row")
	})

	t.Run("ctx ends while waiting", func(t *testing.T) {
		waiting := make(chan struct{})
		f := newFakeTasks(t, func(ctx context.Context, _ int) (*tasksapi.WaitResponse, error) {
			close(waiting)
			<-ctx.Done()
			return nil, ctx.Err()
		})
		ctx, cancel := context.WithCancel(context.Background())
		ch := containerd.WaitExit(ctx, dialFake(t, f), "k8s.io", "c1", "")
		<-waiting
		cancel()
		requireClosedEmpty(t, ch)
	})

	t.Run("ctx ends during an outage", func(t *testing.T) {
		f := newFakeTasks(t, func(context.Context, int) (*tasksapi.WaitResponse, error) { return nil, unavailable })
		ctx, cancel := context.WithCancel(context.Background())
		ch := containerd.WaitExit(ctx, dialFake(t, f), "k8s.io", "c1", "")
		waitFor(t, "a wait again", func() bool { return len(f.callsMade()) >= 2 })
		cancel()
		requireClosedEmpty(t, ch)
	})

	t.Run("nil connection", func(t *testing.T) {
		assert.PanicsWithValue(t, "containerd: WaitExit with a nil connection", func() {
			containerd.WaitExit(context.Background(), nil, "k8s.io", "c1", "")
		})
	})
}

// TestWaitExitAcrossABrokenConnection breaks the connection under a wait
// in progress, as a killed daemon does: nothing is delivered while nobody
// listens on the socket, and the exit is once a server is back on it.
func TestWaitExitAcrossABrokenConnection(t *testing.T) {
	first := make(chan struct{})
	f := newFakeTasks(t, func(ctx context.Context, call int) (*tasksapi.WaitResponse, error) {
		if call == 1 {
			close(first)
			<-ctx.Done() // until the server is stopped under it
			return nil, ctx.Err()
		}
		return &tasksapi.WaitResponse{ExitStatus: 9, ExitedAt: timestamppb.Now()}, nil
	})
	conn := dialFake(t, f)
	ch := containerd.WaitExit(context.Background(), conn, "k8s.io", "c1", "")
	<-first
	f.stop()
	// Down for good until served again: the connection has failed at least
	// once, and every wait again since has found nobody.
	waitFor(t, "the connection to fail", func() bool {
		return conn.GetState() == connectivity.TransientFailure
	})
	select {
	case s := <-ch:
		t.Fatalf("delivered %+v while the server was down", s)
	default:
	}
	f.serve(t)
	s := receive(t, ch)
	code, _, err := s.Result()
	require.NoError(t, err)
	assert.Equal(t, uint32(9), code)
	assert.GreaterOrEqual(t, len(f.callsMade()), 2)
}

// TestWaitExitThroughWatchExit plugs WaitExit into the monitor: a task the
// daemon no longer has is reported as containerd reports one, with
// UnknownExitCode.
func TestWaitExitThroughWatchExit(t *testing.T) {
	f := newFakeTasks(t, func(_ context.Context, call int) (*tasksapi.WaitResponse, error) {
		return nil, status.Error(codes.NotFound, "not found")
	})
	h := &seen{}
	m, err := eventmonitor.New(h)
	require.NoError(t, err)
	defer m.Stop()
	<-eventmonitor.WatchExit(context.Background(), m, "c1",
		containerd.WaitExit(context.Background(), dialFake(t, f), "k8s.io", "c1", ""), containerd.TaskExit("c1", "c1", 7))
	got := h.of("c1")
	require.Len(t, got, 1)
	assert.Equal(t, uint32(eventmonitor.UnknownExitCode), got[0].(*events.TaskExit).ExitStatus)
}
