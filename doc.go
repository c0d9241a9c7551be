// Package eventmonitor turns a container runtime's event stream into
// reliable, ordered, per-key handling with exponential backoff. It is what a
// CRI plugin or a node agent embeds instead of writing its own event loop.
//
// Events come from a Subscriber (through a Converter that types and keys
// them), from Submit, or from WatchExit, and go to a Handler. The monitor
// guarantees:
//
//   - Ordered: events of one key are handled one at a time, in the order
//     accepted. A key waiting in backoff holds its later events behind it.
//   - One path per key: no two calls for a key overlap, not even when a call
//     overruns its timeout; the key stays held until the call returns.
//   - Parallel and fair: WithWorkers(n) handles n keys at once, keys taking
//     turns an event each; a stuck call's worker is replaced (WithMaxOverruns).
//   - Exact backoff: a failed event retries after initial × 2^(failures−1),
//     capped, its key's later events waiting behind it. Due times sit in a
//     heap behind one clock timer: no periodic scan, no idle cost.
//   - Nothing vanishes: every accepted event is handled or ignored, is still
//     queued (Stats, Pending), was returned by Forget, or reaches the drop
//     handler with a reason, Stop's included.
//   - Clock-driven: every delay, deadline and timestamp comes from the
//     configured clock, so tests with a fake clock control retries exactly.
//
// The entry points mirror containerd's CRI event monitor (Subscribe, Start,
// Stop, Backoff), and add Run (re-subscription with backoff and a resync
// hook) and Shutdown (drain, then stop).
//
// # Robustness
//
// A handler's error, panic or runtime.Goexit (t.FailNow in a test) fails
// its event, which backs off; a panic is logged with its stack. A panic in
// the converter or the exit builder drops its input with ErrInvalidEvent.
// Other callbacks (the drop handler, Metrics, the resync hook, log hooks, an
// ExitStatus, the Subscriber) are not guarded: their panic is the
// caller's, as in net/http.
//
// Stop waits for the calls in progress, abandoning (and dropping the event
// of) one that overruns its handle timeout and grace, so it returns within
// about the handle timeout, or never with WithHandleTimeout(0) and a handler
// that ignores its ctx. It also waits for the callbacks already running:
// the drop handler, Metrics, a converter, the resync hook and an exit's
// Result. So none of those, nor a handler, may call Stop, Shutdown or
// WaitIdle but in a new goroutine.
package eventmonitor
