package containerd

import (
	"github.com/containerd/containerd/api/events"

	"github.com/eventmonitor/eventmonitor"
)

// K8sNamespace is the containerd namespace of Kubernetes' containers.
const K8sNamespace = "k8s.io"

// Converter keys every event type of containerd's api/events: task and
// container events by container ID (a sandbox's own task by the sandbox's),
// sandbox events by sandbox ID, images and namespaces by name, snapshots by
// key and content by digest. Keys are not prefixed, so a task and its
// container share one order; container IDs are unique per namespace only,
// so filter by one (eventmonitor.WithNamespace).
func Converter() eventmonitor.Converter { return converter }

var converter = eventmonitor.NewConverter(
	eventmonitor.KeyOf(func(e *events.TaskCreate) string { return e.ContainerID }),
	eventmonitor.KeyOf(func(e *events.TaskStart) string { return e.ContainerID }),
	eventmonitor.KeyOf(func(e *events.TaskDelete) string { return e.ContainerID }),
	eventmonitor.KeyOf(func(e *events.TaskExit) string { return e.ContainerID }),
	eventmonitor.KeyOf(func(e *events.TaskOOM) string { return e.ContainerID }),
	eventmonitor.KeyOf(func(e *events.TaskExecAdded) string { return e.ContainerID }),
	eventmonitor.KeyOf(func(e *events.TaskExecStarted) string { return e.ContainerID }),
	eventmonitor.KeyOf(func(e *events.TaskPaused) string { return e.ContainerID }),
	eventmonitor.KeyOf(func(e *events.TaskResumed) string { return e.ContainerID }),
	eventmonitor.KeyOf(func(e *events.TaskCheckpointed) string { return e.ContainerID }),
	eventmonitor.KeyOf(func(e *events.ContainerCreate) string { return e.ID }),
	eventmonitor.KeyOf(func(e *events.ContainerUpdate) string { return e.ID }),
	eventmonitor.KeyOf(func(e *events.ContainerDelete) string { return e.ID }),
	eventmonitor.KeyOf(func(e *events.SandboxCreate) string { return e.SandboxID }),
	eventmonitor.KeyOf(func(e *events.SandboxStart) string { return e.SandboxID }),
	eventmonitor.KeyOf(func(e *events.SandboxExit) string { return e.SandboxID }),
	eventmonitor.KeyOf(func(e *events.ImageCreate) string { return e.Name }),
	eventmonitor.KeyOf(func(e *events.ImageUpdate) string { return e.Name }),
	eventmonitor.KeyOf(func(e *events.ImageDelete) string { return e.Name }),
	eventmonitor.KeyOf(func(e *events.NamespaceCreate) string { return e.Name }),
	eventmonitor.KeyOf(func(e *events.NamespaceUpdate) string { return e.Name }),
	eventmonitor.KeyOf(func(e *events.NamespaceDelete) string { return e.Name }),
	eventmonitor.KeyOf(func(e *events.SnapshotPrepare) string { return e.Key }),
	eventmonitor.KeyOf(func(e *events.SnapshotCommit) string { return e.Key }),
	eventmonitor.KeyOf(func(e *events.SnapshotRemove) string { return e.Key }),
	eventmonitor.KeyOf(func(e *events.ContentCreate) string { return e.Digest }),
	eventmonitor.KeyOf(func(e *events.ContentDelete) string { return e.Digest }),
)
