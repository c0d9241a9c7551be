package containerd

import (
	"time"

	"github.com/containerd/containerd/api/events"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// TaskExit returns the event builder eventmonitor.WatchExit needs to report
// a task's exit as the *events.TaskExit containerd would publish. Both
// WaitExit's channel and the one of containerd's client (task.Wait) fit
// WatchExit as they are: their statuses have Result() (uint32, time.Time,
// error).
//
// id is the exec ID, the container ID for a task's init process.
func TaskExit(containerID, id string, pid uint32) func(code uint32, exitedAt time.Time) any {
	return func(code uint32, exitedAt time.Time) any {
		return &events.TaskExit{
			ContainerID: containerID,
			ID:          id,
			Pid:         pid,
			ExitStatus:  code,
			ExitedAt:    timestamppb.New(exitedAt),
		}
	}
}

// SandboxExit returns the event builder eventmonitor.WatchExit needs to
// report a sandbox's exit as the *events.SandboxExit containerd's CRI
// publishes (SandboxID, ExitStatus, ExitedAt), for an exit channel of the
// sandbox API (containerd's sandbox controller Wait, which the CRI's
// startSandboxExitMonitor reads). It shares Converter's key for the
// sandbox, its ID.
//
// A pause container's task exit (podsandbox's waitSandboxExit reads
// task.Wait, or WaitExit, on the sandbox's own task) is a TaskExit:
// TaskExit(sandboxID, sandboxID, 0).
func SandboxExit(sandboxID string) func(code uint32, exitedAt time.Time) any {
	return func(code uint32, exitedAt time.Time) any {
		return &events.SandboxExit{
			SandboxID:  sandboxID,
			ExitStatus: code,
			ExitedAt:   timestamppb.New(exitedAt),
		}
	}
}
