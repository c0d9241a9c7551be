package containerd

import (
	"fmt"
	"reflect"
	"strconv"
	"strings"

	"github.com/containerd/containerd/api/events"

	"github.com/eventmonitor/eventmonitor"
)

// topics are the topics containerd publishes each event type on. Sandbox
// events went out without the leading slash in some 2.x releases; both
// spellings are asked for.
var topics = map[reflect.Type][]string{
	reflect.TypeFor[*events.TaskCreate]():       {"/tasks/create"},
	reflect.TypeFor[*events.TaskStart]():        {"/tasks/start"},
	reflect.TypeFor[*events.TaskDelete]():       {"/tasks/delete"},
	reflect.TypeFor[*events.TaskExit]():         {"/tasks/exit"},
	reflect.TypeFor[*events.TaskOOM]():          {"/tasks/oom"},
	reflect.TypeFor[*events.TaskExecAdded]():    {"/tasks/exec-added"},
	reflect.TypeFor[*events.TaskExecStarted]():  {"/tasks/exec-started"},
	reflect.TypeFor[*events.TaskPaused]():       {"/tasks/paused"},
	reflect.TypeFor[*events.TaskResumed]():      {"/tasks/resumed"},
	reflect.TypeFor[*events.TaskCheckpointed](): {"/tasks/checkpointed"},
	reflect.TypeFor[*events.ContainerCreate]():  {"/containers/create"},
	reflect.TypeFor[*events.ContainerUpdate]():  {"/containers/update"},
	reflect.TypeFor[*events.ContainerDelete]():  {"/containers/delete"},
	reflect.TypeFor[*events.SandboxCreate]():    {"/sandboxes/create", "sandboxes/create"},
	reflect.TypeFor[*events.SandboxStart]():     {"/sandboxes/start", "sandboxes/start"},
	reflect.TypeFor[*events.SandboxExit]():      {"/sandboxes/exit", "sandboxes/exit"},
	reflect.TypeFor[*events.ImageCreate]():      {"/images/create"},
	reflect.TypeFor[*events.ImageUpdate]():      {"/images/update"},
	reflect.TypeFor[*events.ImageDelete]():      {"/images/delete"},
	reflect.TypeFor[*events.NamespaceCreate]():  {"/namespaces/create"},
	reflect.TypeFor[*events.NamespaceUpdate]():  {"/namespaces/update"},
	reflect.TypeFor[*events.NamespaceDelete]():  {"/namespaces/delete"},
	reflect.TypeFor[*events.SnapshotPrepare]():  {"/snapshot/prepare"},
	reflect.TypeFor[*events.SnapshotCommit]():   {"/snapshot/commit"},
	reflect.TypeFor[*events.SnapshotRemove]():   {"/snapshot/remove"},
	reflect.TypeFor[*events.ContentCreate]():    {"/content/create"},
	reflect.TypeFor[*events.ContentDelete]():    {"/content/delete"},
}

// Filters returns daemon-side filters for only the event types keys
// convert, in namespace if not "", so that events no handler wants never
// cross the socket. It names any key that is not a containerd event type;
// such a type needs a filter of one's own.
func Filters(namespace string, keys ...eventmonitor.TypeKey) ([]string, error) {
	var filters, unknown []string
	for _, k := range keys {
		names, ok := topics[k.Type()]
		if !ok {
			unknown = append(unknown, fmt.Sprint(k.Type()))
			continue
		}
		for _, topic := range names {
			f := "topic==" + strconv.Quote(topic)
			if namespace != "" {
				f = "namespace==" + strconv.Quote(namespace) + "," + f
			}
			filters = append(filters, f)
		}
	}
	if len(unknown) > 0 {
		return nil, fmt.Errorf("containerd: no known topic for %s: not a containerd event type", strings.Join(unknown, ", "))
	}
	return filters, nil
}
