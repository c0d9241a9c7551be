// Command bench runs eventmonitor, client-go's workqueue (with a per-key
// event FIFO beside it) and containerd's CRI serial event loop through the
// same scenarios in one process, and prints one table of figures and ratios.
//
//	go run ./bench                 # every scenario, about two minutes
//	go run ./bench -only fast,envelope
//
// It is a module of its own so that the library never depends on client-go.
package main

import (
	"flag"
	"fmt"
	"math"
	"os"
	"runtime"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/containerd/log"
)

type row struct {
	scenario, measure string
	values            [3]string // eventmonitor, workqueue, serial loop
	ratio             string
}

func main() {
	events := flag.Int("events", 1_000_000, "fast path: events per run")
	keyCount := flag.Int("keys", 1000, "keys the fast path, head-of-line and envelope events spread over")
	holFor := flag.Duration("hol", 3*time.Second, "head-of-line: how long each run paces events")
	idle := flag.Duration("idle", 5*time.Second, "backoff at scale: idle period measured")
	sizes := flag.String("sizes", "1000,10000,100000", "backoff at scale: keys in backoff")
	only := flag.String("only", "", "comma-separated scenarios to run: fast, hol, backoff, retry, envelope, e2e")
	runs := flag.Int("runs", 3, "fast, envelope and end-to-end runs of each, interleaved; the median is shown")
	e2eN := flag.Int("e2e-n", 20_000, "end to end: events per run")
	flag.Parse()
	if *e2eVariant != "" { // this process is the end-to-end scenario's subscriber
		if err := e2eSubscriber(*e2eVariant, *e2eSocket, *e2eEvents); err != nil {
			fmt.Fprintln(os.Stderr, "bench: subscriber:", err)
			os.Exit(1)
		}
		return
	}
	log.L.Logger.SetLevel(log.FatalLevel) // the failing handlers are on purpose: their error lines are not news

	want := func(s string) bool { return *only == "" || strings.Contains(","+*only+",", ","+s+",") }
	keys := keyNames(*keyCount)
	var rows []row
	if want("fast") {
		rows = append(rows, fastRows(keys, *events, *runs)...)
	}
	if want("hol") {
		rows = append(rows, holRows(keys, *holFor)...)
	}
	if want("backoff") {
		rows = append(rows, backoffRows(*sizes, *idle)...)
	}
	if want("retry") {
		rows = append(rows, retryRows()...)
	}
	if want("envelope") {
		rows = append(rows, envelopeRows(keys, *events/5, *runs)...)
	}

	fmt.Printf("%s, %d CPUs, %s/%s\n\n", runtime.Version(), runtime.NumCPU(), runtime.GOOS, runtime.GOARCH)
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "scenario\tmeasure\teventmonitor\tworkqueue\tserial loop\teventmonitor's advantage")
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", r.scenario, r.measure, r.values[0], r.values[1], r.values[2], r.ratio)
	}
	w.Flush()
	fmt.Println("\nadvantage: how many times better eventmonitor's figure is (higher throughput, or lower time)")
	if want("e2e") {
		e2eTable(*e2eN, *runs)
	}
}

// advantage formats ours against workqueue's and the serial loop's.
func advantage(ours, wq, serial float64, higherIsBetter bool) string {
	times := func(theirs float64) string {
		if ours == 0 || theirs == 0 || math.IsNaN(theirs) {
			return "—"
		}
		if higherIsBetter {
			return fmt.Sprintf("%.2f×", ours/theirs)
		}
		return fmt.Sprintf("%.2f×", theirs/ours)
	}
	return fmt.Sprintf("%s vs workqueue, %s vs serial", times(wq), times(serial))
}

// medianOf returns the median of runs measurements of each of fs, taken in
// turn (f0, f1, f2, f0, ...) so that a noisy spell on a shared machine does
// not fall on one contender only.
func medianOf(runs int, fs ...func() float64) []float64 {
	all := make([][]float64, len(fs))
	for range max(1, runs) {
		for i, f := range fs {
			all[i] = append(all[i], f())
		}
	}
	out := make([]float64, len(fs))
	for i, xs := range all {
		slices.Sort(xs)
		out[i] = xs[len(xs)/2]
	}
	return out
}

func fastRows(keys []string, n, runs int) []row {
	var rows []row
	for _, timed := range []bool{false, true} {
		for _, workers := range []int{1, 4} {
			rows = append(rows, fastRowsOf(keys, n, runs, workers, timed)...)
		}
	}
	return rows
}

// fastRowsOf measures the fast path with workers, like for like: no
// contender giving its calls a deadline (eventmonitor with
// WithHandleTimeout(0)), or, if timed, every call with one, the peers' from
// context.WithTimeout (containerd's CRI monitor gives 10 s).
func fastRowsOf(keys []string, n, runs, workers int, timed bool) []row {
	callTimeout := time.Duration(0)
	scenario := fmt.Sprintf("1. fast path, %d worker(s), no call with a deadline", workers)
	if timed {
		callTimeout = 10 * time.Second // the monitor's default
		scenario = fmt.Sprintf("1. fast path, %d worker(s), every call with a deadline", workers)
	}
	var rates, allocs [3]float64
	var fs []func() float64
	for i, c := range contenders {
		fs = append(fs, func() float64 {
			rate, a := fastPath(c.new, workers, n, keys, callTimeout)
			allocs[i] = a // steady from run to run; the last is shown
			return rate
		})
	}
	copy(rates[:], medianOf(runs, fs...))
	rows := []row{
		{scenario, "events/s", fmtEach(rates, func(v float64) string { return fmt.Sprintf("%.2fM", v/1e6) }),
			advantage(rates[0], rates[1], rates[2], true)},
		{scenario, "allocs/event", fmtEach(allocs, func(v float64) string { return fmt.Sprintf("%.2f", v) }), ""},
	}
	rows[0].values[2] += " (1 goroutine)"
	if workers > 1 {
		rows[1].values[2] = "—" // the same single goroutine as with 1 worker
	}
	return rows
}

func holRows(keys []string, d time.Duration) []row {
	var rows []row
	for _, slow := range []bool{false, true} {
		var p50, p99 [3]float64
		for i, c := range contenders {
			a, b := headOfLine(c.new, 4, 20_000, keys, d, slow)
			p50[i], p99[i] = a.Seconds(), b.Seconds()
		}
		scenario := "2. head-of-line, 20k ev/s, 4 workers"
		if slow {
			scenario += ", slow key"
		} else {
			scenario += ", no slow key"
		}
		rows = append(rows,
			row{scenario, "fast p50", fmtEach(p50, fmtSeconds), advantage(p50[0], p50[1], p50[2], false)},
			row{scenario, "fast p99", fmtEach(p99, fmtSeconds), advantage(p99[0], p99[1], p99[2], false)})
	}
	return rows
}

func backoffRows(sizes string, idle time.Duration) []row {
	var rows []row
	floor := idleCPU(idle)
	for _, field := range strings.Split(sizes, ",") {
		var n int
		if _, err := fmt.Sscan(field, &n); err != nil || n <= 0 {
			fmt.Fprintf(os.Stderr, "bench: bad -sizes entry %q\n", field)
			os.Exit(2)
		}
		keys := keyNames(n)
		var cpu, bytes, put, take [3]float64
		for i, c := range contenders {
			c1, b, p, t := backoffAtScale(c.new, keys, idle)
			cpu[i], bytes[i], put[i], take[i] = c1.Seconds(), b, p.Seconds(), t.Seconds()
		}
		scenario := fmt.Sprintf("3. backoff, %d keys", n)
		take[1] = math.NaN() // workqueue cannot take a key out of its delaying heap
		rows = append(rows,
			row{scenario, fmt.Sprintf("CPU over %v idle", idle), fmtEach(cpu, fmtSeconds),
				fmt.Sprintf("process floor %s", fmtSeconds(floor.Seconds()))},
			row{scenario, "heap bytes/key", fmtEach(bytes, func(v float64) string { return fmt.Sprintf("%.0f", v) }),
				advantage(bytes[0], bytes[1], bytes[2], false)},
			row{scenario, "put a key in", fmtEach(put, fmtSeconds), advantage(put[0], put[1], put[2], false)},
			row{scenario, "take a key out", fmtEach(take, fmtSeconds), "workqueue cannot remove a waiting key"})
	}
	return rows
}

func retryRows() []row {
	const delay = 10 * time.Millisecond
	keys := keyNames(500)
	var p50, p99, worst [3]float64
	for i, c := range contenders {
		a, b, w := retryPrecision(c.new, keys, delay)
		p50[i], p99[i], worst[i] = a.Seconds(), b.Seconds(), w.Seconds()
	}
	scenario := "4. retry lateness, 10 ms delay (serial: 10 ms tick)"
	return []row{
		{scenario, "p50", fmtEach(p50, fmtSeconds), advantage(p50[0], p50[1], p50[2], false)},
		{scenario, "p99", fmtEach(p99, fmtSeconds), advantage(p99[0], p99[1], p99[2], false)},
		{scenario, "max", fmtEach(worst, fmtSeconds), ""},
	}
}

func envelopeRows(keys []string, n, runs int) []row {
	payloads := taskExitPayloads(keys)
	cases := []struct {
		workers int
		waiting bool
	}{{1, false}, {4, false}, {1, true}}
	// The floors: typeurl decoding alone (the measure) and the
	// converter the monitor uses, which decodes faster; each in a bare loop
	// and fed through a channel, as a live feed delivers envelopes.
	fs := []func() float64{
		func() float64 { return decodeLoop(payloads, n, unmarshal) },
		func() float64 { return decodeFromChannel(payloads, n, unmarshal) },
		func() float64 { return decodeLoop(payloads, n, convert) },
		func() float64 { return decodeFromChannel(payloads, n, convert) },
	}
	for _, c := range cases {
		fs = append(fs, func() float64 { return envelopePath(payloads, c.workers, n, c.waiting) })
	}
	rates := medianOf(runs, fs...)
	decoding, converting, convertingFromChannel := rates[0], rates[2], rates[3]
	const scenario = "5. envelope path (TaskExit)"
	floors := []string{
		"typeurl.UnmarshalAny in a loop",
		"typeurl.UnmarshalAny, fed through a channel",
		"the converter in a loop",
		"the converter, fed through a channel",
	}
	var rows []row
	for i, name := range floors {
		rows = append(rows, row{scenario + ": " + name, "events/s", [3]string{fmt.Sprintf("%.2fM", rates[i]/1e6), "—", "—"},
			fmt.Sprintf("%.2f of decoding alone", rates[i]/decoding)})
	}
	for i, c := range cases {
		rate := rates[len(floors)+i]
		name := fmt.Sprintf("%s, %d worker(s), live feed", scenario, c.workers)
		versus := fmt.Sprintf("%.2f of the converter fed through a channel", rate/convertingFromChannel)
		if c.waiting {
			name = fmt.Sprintf("%s, %d worker(s), all waiting", scenario, c.workers)
			versus = fmt.Sprintf("%.2f of the converter in a loop", rate/converting)
		}
		rows = append(rows, row{name, "events/s", [3]string{fmt.Sprintf("%.2fM", rate/1e6), "—", "—"},
			fmt.Sprintf("%.2f of decoding alone; %s", rate/decoding, versus)})
	}
	return rows
}

func fmtEach(v [3]float64, f func(float64) string) [3]string {
	var out [3]string
	for i := range v {
		if math.IsNaN(v[i]) {
			out[i] = "—"
		} else {
			out[i] = f(v[i])
		}
	}
	return out
}

func fmtSeconds(s float64) string {
	switch d := time.Duration(s * float64(time.Second)); {
	case d >= time.Second:
		return fmt.Sprintf("%.2fs", d.Seconds())
	case d >= time.Millisecond:
		return fmt.Sprintf("%.2fms", float64(d)/float64(time.Millisecond))
	case d >= time.Microsecond:
		return fmt.Sprintf("%.1fµs", float64(d)/float64(time.Microsecond))
	default:
		return fmt.Sprintf("%dns", d.Nanoseconds())
	}
}
