// Package relist generates container lifecycle events by relisting, as
// kubelet's PLEG does: it lists every pod and container periodically,
// compares the listing with the last one, and emits Started, Died, Removed
// (and optionally Changed) events for what changed.
//
// Streams miss events (a runtime restarts, a subscription breaks, a shim
// dies without an exit event); a relist finds the difference. Unlike
// kubelet's GenericPLEG it loses nothing: a pod whose inspection or event
// sink fails keeps its old record, so its events come again next relist, and
// it is inspected again. Inspections of different pods run in parallel.
//
// Feed a Monitor with ToMonitor, and pass Relist to the monitor's WithResync
// hook to relist at once whenever the event stream had to be re-subscribed.
package relist
