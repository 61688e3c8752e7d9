package forwarder

import "time"

// SetScheduledRecheck sets how long r waits before it looks again for a
// scheduled table it did not find (a minute otherwise), for the tests
// that create the table while the relay runs.
func SetScheduledRecheck(r *Relay, d time.Duration) { r.recheck = d }
