package containerd

import (
	"context"
	"errors"
	"fmt"
	"time"

	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	"github.com/containerd/log"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/eventmonitor/eventmonitor"
)

// ErrTaskGone: the daemon has no such task (it answered NotFound), so its
// exit status can no longer be read. The task was deleted, or the daemon
// lost it, for instance because its shim died; containerd then publishes a
// TaskExit of its own with status 255. WaitExit's error wraps it; test it
// with errors.Is.
var ErrTaskGone = errors.New("containerd: task gone (the daemon has no such task; its exit status cannot be read)")

// namespaceHeader is the gRPC metadata key carrying containerd's namespace.
const namespaceHeader = "containerd-namespace"

// The pace of WaitExit's waits again after a broken one: doubling from
// waitRetryInitial up to waitRetryMax, so that the exit of a task whose
// daemon was restarted is delivered within about waitRetryMax of the daemon
// being back. The socket is local: trying once a second costs nothing.
const (
	waitRetryInitial = 100 * time.Millisecond
	waitRetryMax     = time.Second
)

// waitOtherAttempts is how many waits in a row may fail with an error other
// than a transport error or NotFound before WaitExit gives up and delivers
// it. A shim that dies under a live daemon fails the wait first with an
// error of no particular code (ttrpc: closed), and the daemon only then
// removes the task (NotFound): a second attempt says "gone" instead.
const waitOtherAttempts = 3

// ExitStatus is a task's exit as WaitExit delivers it. Result makes it an
// eventmonitor.ExitStatus, so that WaitExit's channel plugs into
// eventmonitor.WatchExit as it is; ExitCode, ExitTime
// and Error read as containerd's client type of the same name does.
type ExitStatus struct {
	code     uint32
	exitedAt time.Time
	err      error
}

// Result returns the exit code and time, or, when the status could not be
// read, eventmonitor.UnknownExitCode, a zero time and why.
func (s ExitStatus) Result() (uint32, time.Time, error) { return s.code, s.exitedAt, s.err }

// ExitCode is the process's exit code; eventmonitor.UnknownExitCode when
// Error is not nil.
func (s ExitStatus) ExitCode() uint32 { return s.code }

// ExitTime is when the process exited; zero when Error is not nil.
func (s ExitStatus) ExitTime() time.Time { return s.exitedAt }

// Error is why the status could not be read (ErrTaskGone, or an error the
// daemon kept answering with), nil for a real exit.
func (s ExitStatus) Error() error { return s.err }

// WaitExit waits on conn for the exit of a task's process (execID "" for
// its init process) and delivers it on the returned channel, which is then
// closed, or closed empty when ctx ends first. Unlike containerd's
// task.Wait, a broken connection is not an exit: it waits again, backing off
// from 100 ms to 1 s, until the daemon is back. An Error wrapping
// ErrTaskGone says the daemon no longer has the task; another error is one
// the daemon gave 3 times in a row. A nil conn panics.
func WaitExit(ctx context.Context, conn grpc.ClientConnInterface, namespace, containerID, execID string) <-chan ExitStatus {
	if conn == nil {
		panic("containerd: WaitExit with a nil connection")
	}
	w := newWaiter(conn, namespace, containerID, execID)
	ch := make(chan ExitStatus, 1)
	go func() {
		defer close(ch)
		if s, ok := w.wait(ctx); ok {
			ch <- s
		}
	}()
	return ch
}

type waiter struct {
	client tasksapi.TasksClient
	req    *tasksapi.WaitRequest
	ns     string
	conn   wakeable // nil unless the connection can be woken
}

func newWaiter(conn grpc.ClientConnInterface, namespace, containerID, execID string) *waiter {
	w := &waiter{client: tasksapi.NewTasksClient(conn), ns: namespace,
		req: &tasksapi.WaitRequest{ContainerID: containerID, ExecID: execID}}
	w.conn, _ = conn.(wakeable)
	return w
}

// wait calls Wait until it yields a status to deliver; false when ctx ended.
func (w *waiter) wait(ctx context.Context) (ExitStatus, bool) {
	logger := func() *log.Entry { // only when it logs: most waits never do
		l := log.G(ctx).WithField("container", w.req.ContainerID)
		if w.req.ExecID != "" {
			l = l.WithField("exec", w.req.ExecID)
		}
		return l
	}
	callCtx := metadata.AppendToOutgoingContext(ctx, namespaceHeader, w.ns)
	delay, others, outage := waitRetryInitial, 0, false
	for {
		began := time.Now()
		resp, err := w.client.Wait(callCtx, w.req)
		switch {
		case ctx.Err() != nil:
			return ExitStatus{}, false
		case err == nil:
			if outage {
				logger().Info("task exit read after the connection to containerd was restored")
			}
			return ExitStatus{code: resp.GetExitStatus(), exitedAt: resp.GetExitedAt().AsTime()}, true
		case status.Code(err) == codes.NotFound:
			return w.failed(fmt.Errorf("%w: %s in namespace %q: %w", ErrTaskGone, w.what(), w.ns, err)), true
		case isTransportError(err):
			others = 0
			if !outage {
				logger().WithError(err).Warn("waiting for a task's exit: connection to containerd lost; waiting again once it is back")
				outage = true
			}
		default:
			others++
			if others >= waitOtherAttempts {
				return w.failed(fmt.Errorf("containerd: wait for %s in namespace %q: %w", w.what(), w.ns, err)), true
			}
			logger().WithError(err).Debug("waiting for a task's exit failed; trying again")
		}
		// A wait that was established and broke later (the daemon went away
		// under it) starts a fresh backoff: the daemon may be back at once.
		if time.Since(began) > waitRetryMax {
			delay = waitRetryInitial
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return ExitStatus{}, false
		case <-t.C:
		}
		delay = min(2*delay, waitRetryMax)
		wakeConnection(ctx, w.conn)
	}
}

func (w *waiter) failed(err error) ExitStatus {
	return ExitStatus{code: eventmonitor.UnknownExitCode, err: err}
}

func (w *waiter) what() string {
	if w.req.ExecID != "" {
		return fmt.Sprintf("exec %q of task %q", w.req.ExecID, w.req.ContainerID)
	}
	return fmt.Sprintf("task %q", w.req.ContainerID)
}

// isTransportError reports whether err says the connection to the daemon
// broke rather than anything about the task. gRPC reports a refused, reset
// or closed connection, and EOF on it, as Unavailable. A daemon shutting
// down may also end calls in progress as cancelled, or past a deadline,
// although the caller's ctx is neither: that is the daemon going away too.
func isTransportError(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.Canceled, codes.DeadlineExceeded:
		return true
	}
	return false
}
