package containerd

import (
	"time"

	"github.com/containerd/containerd/api/events"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// TaskExit returns the event builder eventmonitor.WatchExit needs to report
// a task's exit as the *events.TaskExit containerd would publish. The exit
// channel of containerd's client (task.Wait) fits WatchExit as it is:
// containerd.ExitStatus has Result() (uint32, time.Time, error).
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
