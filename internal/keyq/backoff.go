package keyq

import (
	"math"
	"time"
)

// Delays is the backoff policy.
type Delays struct {
	Initial, Max time.Duration
	Jitter       float64        // 0..1: spread each delay by up to ±Jitter of itself
	Rand         func() float64 // [0, 1); needed only with Jitter
}

// backoff is a key's record while it is in backoff: waiting or replaying.
type backoff struct {
	delay       time.Duration
	due         time.Time // when the replay starts; kept while the key waits
	replayLeft  int       // replay events at the queue's head not yet taken
	taken       int       // replay events taken so far: a Running key's call is the replay's
	afterReplay time.Time // set by PushBackoff during the replay: the key waits until then once it ends
}

// inReplayCall reports whether k is Running a call of its replay.
func (k *Key[T]) inReplayCall() bool {
	return k.phase == Running && k.backoff != nil && k.backoff.taken > 0
}

// replaying reports whether k's replay is under way: events of it are left
// to take, or one of its calls runs.
func (k *Key[T]) replaying() bool {
	return k.backoff != nil && (k.backoff.replayLeft > 0 || k.inReplayCall())
}

// Due is when a key in backoff replays (past while it replays).
func (k *Key[T]) Due() time.Time {
	if k.backoff == nil {
		return time.Time{}
	}
	return k.backoff.due
}

// Delay is the key's backoff delay, 0 outside backoff.
func (k *Key[T]) Delay() time.Duration {
	if k.backoff == nil {
		return 0
	}
	return k.backoff.delay
}

// Doubled is 2d, capped at limit, without overflowing (d ≤ limit/2 ⇒ 2d ≤
// limit, halves rounded down): the one doubling rule, for keys' backoff
// and the monitor's re-subscription.
func Doubled(d, limit time.Duration) time.Duration {
	if d > limit/2 {
		return limit
	}
	return 2 * d
}

// dueAfter is now plus d spread by the jitter, saturating rather than
// overflowing near the largest Duration.
func (s *Set[T]) dueAfter(now time.Time, d time.Duration) time.Time {
	if j := s.delays.Jitter; j > 0 {
		spread := float64(d) * (1 + j*(2*s.delays.Rand()-1))
		switch {
		case spread >= math.MaxInt64: // float64(MaxInt64) is 2^63: not a Duration
			d = math.MaxInt64
		case spread < 1:
			d = 1
		default:
			d = time.Duration(spread)
		}
	}
	return now.Add(d)
}
