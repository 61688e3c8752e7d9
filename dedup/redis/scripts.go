package redis

// The scripts run atomically inside Redis, one round trip each. Times are
// Unix milliseconds read from the server's clock (TIME), so that clients
// with skewed clocks agree on when a lease ends. Every number written into
// the hash is formatted with %d: Lua's default number formatting would turn
// a millisecond timestamp into an imprecise exponent form.
//
// redis.replicate_commands() lets a script write after TIME on Redis < 5,
// where whole scripts rather than their effects are replicated; from Redis
// 5 on it is a no-op (and it is skipped where it no longer exists).

// claimSource takes the key for lease unless it is done, dead or held by a
// live lease. KEYS[1] is the record; ARGV[1] the lease and ARGV[2] the
// record's time to live, both in milliseconds.
//
// The reply is {state, attempts, token, lease_until, first_failed_at,
// result}, with 0 for a time or token that does not apply. The new token
// is the larger of the previous token + 1 and the server's time in
// microseconds: it grows with every claim of the key, and a token issued
// after the record expired or was lost (eviction, failover, restart) is
// still higher than the tokens issued before, as long as the servers'
// clocks agree. Microseconds rather than milliseconds keep that true for a
// record deleted and claimed again at once: a claim, the deletion and the
// next claim take more than a microsecond on one server.
const claimSource = `
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local r = redis.call('HMGET', KEYS[1], 'status', 'token', 'lease_until', 'attempts', 'result', 'first_failed_at')
local attempts = tonumber(r[4]) or 0
local firstFailed = tonumber(r[6]) or 0
if r[1] == 'done' then
	return {'done', attempts, 0, 0, firstFailed, r[5]}
end
if r[1] == 'dead' then
	return {'dead', attempts, 0, 0, firstFailed}
end
local leaseUntil = tonumber(r[3]) or 0
if r[1] == 'processing' and now < leaseUntil then
	return {'in_flight', attempts, 0, leaseUntil, firstFailed}
end
local token = (tonumber(r[2]) or 0) + 1
local micros = tonumber(t[1]) * 1000000 + tonumber(t[2])
if token < micros then token = micros end
attempts = attempts + 1
leaseUntil = now + tonumber(ARGV[1])
redis.call('HSET', KEYS[1], 'status', 'processing', 'token', string.format('%d', token),
	'lease_until', string.format('%d', leaseUntil), 'attempts', string.format('%d', attempts))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'new', attempts, token, leaseUntil, firstFailed}
`

// completeSource marks the key done with its result if ARGV[1] is the
// current token of a key being processed. ARGV[2] is the result, stored only
// when ARGV[3] is '1' (a nil result stores none). The reply is 1 when the
// key was completed, 0 when the lease was lost.
const completeSource = `
if redis.replicate_commands then redis.replicate_commands() end
local r = redis.call('HMGET', KEYS[1], 'status', 'token')
if r[1] ~= 'processing' or r[2] ~= ARGV[1] then
	return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HDEL', KEYS[1], 'lease_until', 'result')
redis.call('HSET', KEYS[1], 'status', 'done', 'done_at', string.format('%d', now))
if ARGV[3] == '1' then
	redis.call('HSET', KEYS[1], 'result', ARGV[2])
end
return 1
`

// releaseSource marks the key failed, claimable at once, if ARGV[1] is the
// current token of a key being processed, and records the failure: ARGV[2]
// is its error text, ARGV[3] when it happened (milliseconds, or empty for the
// server's time). The first error and time are kept once set. The attempt
// was counted by the claim. When ARGV[4] is '1' the attempt was abandoned
// (the consumer shut down): its count is taken back and no failure is
// recorded. The reply is 1 when the key was released, 0 when the lease was
// lost.
const releaseSource = `
if redis.replicate_commands then redis.replicate_commands() end
local r = redis.call('HMGET', KEYS[1], 'status', 'token', 'attempts')
if r[1] ~= 'processing' or r[2] ~= ARGV[1] then
	return 0
end
if ARGV[4] == '1' then
	local attempts = (tonumber(r[3]) or 0) - 1
	if attempts < 0 then attempts = 0 end
	redis.call('HDEL', KEYS[1], 'lease_until')
	redis.call('HSET', KEYS[1], 'status', 'failed', 'attempts', string.format('%d', attempts))
	return 1
end
local at = ARGV[3]
if at == '' then
	local t = redis.call('TIME')
	at = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end
redis.call('HDEL', KEYS[1], 'lease_until')
redis.call('HSET', KEYS[1], 'status', 'failed', 'last_error', ARGV[2], 'last_failed_at', at)
redis.call('HSETNX', KEYS[1], 'first_error', ARGV[2])
redis.call('HSETNX', KEYS[1], 'first_failed_at', at)
return 1
`

// burySource marks the key dead, until it is reopened, if ARGV[1] is the
// current token of a key being processed, and records the failure with the
// arguments of releaseSource. It clears the key's replay grant: a grant
// reopens a key once. The record keeps its expiry. The reply is 1 when the
// key was buried, 0 when the lease was lost.
const burySource = `
if redis.replicate_commands then redis.replicate_commands() end
local r = redis.call('HMGET', KEYS[1], 'status', 'token')
if r[1] ~= 'processing' or r[2] ~= ARGV[1] then
	return 0
end
local at = ARGV[3]
if at == '' then
	local t = redis.call('TIME')
	at = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end
redis.call('HDEL', KEYS[1], 'lease_until', 'replay_grant')
redis.call('HSET', KEYS[1], 'status', 'dead', 'last_error', ARGV[2], 'last_failed_at', at)
redis.call('HSETNX', KEYS[1], 'first_error', ARGV[2])
redis.call('HSETNX', KEYS[1], 'first_failed_at', at)
return 1
`

// extendSource moves the end of the lease of ARGV[1], if it is the current
// token of a key being processed, to ARGV[2] milliseconds from now, and
// makes the record live at least that long. The reply is the new lease end
// in milliseconds, or 0 when the lease was lost.
const extendSource = `
if redis.replicate_commands then redis.replicate_commands() end
local r = redis.call('HMGET', KEYS[1], 'status', 'token')
if r[1] ~= 'processing' or r[2] ~= ARGV[1] then
	return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local leaseUntil = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'lease_until', string.format('%d', leaseUntil))
local ttl = redis.call('PTTL', KEYS[1])
if ttl >= 0 and ttl < tonumber(ARGV[2]) then
	redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return leaseUntil
`

// grantSource writes the replay grant ARGV[1] on a dead key. The reply is
// 1 when the key was dead, else 0.
const grantSource = `
if redis.call('HGET', KEYS[1], 'status') ~= 'dead' then
	return 0
end
redis.call('HSET', KEYS[1], 'replay_grant', ARGV[1])
return 1
`

// reopenSource makes a dead key claimable again, as a failed key with no
// attempts, if ARGV[1] is its replay grant; its failure history and expiry
// stay. The reply is 1 when the key was reopened, else 0.
const reopenSource = `
local r = redis.call('HMGET', KEYS[1], 'status', 'replay_grant')
if r[1] ~= 'dead' or r[2] ~= ARGV[1] then
	return 0
end
redis.call('HSET', KEYS[1], 'status', 'failed', 'attempts', '0')
return 1
`

// deadCopySource counts a copy of a dead key in its dead_copies field, and
// does nothing to a key that is not dead.
const deadCopySource = `
if redis.call('HGET', KEYS[1], 'status') == 'dead' then
	redis.call('HINCRBY', KEYS[1], 'dead_copies', 1)
end
return 0
`

// peekSource reads the key without writing. The reply is
// {state, attempts, lease_until, first_failed_at, result}.
const peekSource = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local r = redis.call('HMGET', KEYS[1], 'status', 'attempts', 'lease_until', 'result', 'first_failed_at')
local attempts = tonumber(r[2]) or 0
local firstFailed = tonumber(r[5]) or 0
if r[1] == 'done' then
	return {'done', attempts, 0, firstFailed, r[4]}
end
if r[1] == 'dead' then
	return {'dead', attempts, 0, firstFailed}
end
local leaseUntil = tonumber(r[3]) or 0
if r[1] == 'processing' and now < leaseUntil then
	return {'in_flight', attempts, leaseUntil, firstFailed}
end
return {'new', attempts, 0, firstFailed}
`

// ClaimScript returns the Lua source that [Store.LeaseClaim] runs with
// EVALSHA (KEYS[1] the record, ARGV[1] the lease and ARGV[2] the window, in
// milliseconds), so that the server's own rate for it can be measured, e.g.
// with redis-benchmark, and compared with the store's.
func ClaimScript() string { return claimSource }
