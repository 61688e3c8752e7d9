// A RabbitMQ consumer in Node.js that keeps oncemill's inbox table by SQL
// alone, as docs/consumers.md describes: it claims the message's key in
// the transaction of its effect, applies the effect, and commits, so that
// the key is done exactly when the effect is; a duplicate finds the key
// done and is acked without running. A failed effect is rolled back and
// recorded as failed, in a transaction of its own, and the message goes
// back to the queue.
//
// Usage: node consumer.js AMQP_URL PG_URL SCHEMA QUEUE CONSUMER FAIL_KEY
//
// The effect counts one application per consumer and key in
// SCHEMA.effects (consumer, key, applied). Its first attempt on FAIL_KEY
// fails, to take the failed path. After each commit it prints
// "committed KEY" on stdout, before the ack.
"use strict";

const amqp = require("amqplib");
const { Client } = require("pg");

const [amqpURL, pgURL, schema, queue, consumer, failKey] = process.argv.slice(2);
const inbox = `"${schema}".inbox`;
const failures = `"${schema}".inbox_failures`;
const starts = `"${schema}".inbox_starts`;
const effects = `"${schema}".effects`;
const windowSeconds = 72 * 3600; // the Go inbox's default Window

// The statements of dedup/postgres, for consumer $1 and key $2.
const sql = {
  // Takes a new key as done, visible at commit; answers the status of a
  // key that has a row.
  claim: `WITH del AS (
	DELETE FROM ${starts} WHERE consumer = $1 AND key = $2
), ins AS (
	INSERT INTO ${inbox} (consumer, key, status, done_at, expires_at)
	VALUES ($1, $2, 'done', now(), now() + make_interval(secs => $3))
	ON CONFLICT (consumer, key) DO NOTHING
	RETURNING 1
)
SELECT 'new'::text AS status, 1 AS attempts FROM ins
UNION ALL
SELECT status, 0 AS attempts FROM ${inbox}
WHERE consumer = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM ins)`,
  // Takes a key whose earlier attempts failed, and counts the attempt on
  // its failure row.
  reclaim: `WITH del AS (
	DELETE FROM ${starts} WHERE consumer = $1 AND key = $2
), up AS (
	UPDATE ${inbox} SET status = 'done', lease_until = NULL, done_at = now(),
		expires_at = now() + make_interval(secs => $3)
	WHERE consumer = $1 AND key = $2 AND status = 'failed'
	RETURNING 1
)
INSERT INTO ${failures} AS f (consumer, key, attempts) SELECT $1, $2, 1 FROM up
ON CONFLICT (consumer, key) DO UPDATE SET attempts = f.attempts + 1, updated_at = now()
RETURNING attempts`,
  read: `SELECT status, 0 AS attempts FROM ${inbox} WHERE consumer = $1 AND key = $2`,
  // In a transaction of its own, after the rollback.
  fail: `WITH up AS (
	INSERT INTO ${inbox} AS i (consumer, key, status, expires_at)
	VALUES ($1, $2, 'failed', now() + make_interval(secs => $4))
	ON CONFLICT (consumer, key) DO UPDATE
	SET status = 'failed', lease_until = NULL, expires_at = EXCLUDED.expires_at
	WHERE i.status NOT IN ('done', 'dead')
	RETURNING 1
)
INSERT INTO ${failures} AS f (consumer, key, attempts, first_error, last_error, first_failed_at, last_failed_at)
SELECT $1, $2, 1, $3, $3, now(), now() FROM up
ON CONFLICT (consumer, key) DO UPDATE
SET attempts = f.attempts + 1,
    first_error = COALESCE(f.first_error, EXCLUDED.first_error),
    first_failed_at = COALESCE(f.first_failed_at, EXCLUDED.first_failed_at),
    last_error = EXCLUDED.last_error, last_failed_at = EXCLUDED.last_failed_at, updated_at = now()`,
  deadCopy: `UPDATE ${failures} SET dead_copies = dead_copies + 1
WHERE consumer = $1 AND key = $2
AND EXISTS (SELECT 1 FROM ${inbox} WHERE consumer = $1 AND key = $2 AND status = 'dead')`,
};

// claim runs in the open transaction and returns 'new' (claimed: run the
// effect), 'done' (a duplicate) or 'dead'.
async function claim(db, key) {
  let { rows } = await db.query(sql.claim, [consumer, key, windowSeconds]);
  if (rows.length === 0) {
    // A concurrent claimer committed while the INSERT waited: a new
    // statement sees its row.
    ({ rows } = await db.query(sql.read, [consumer, key]));
  }
  let { status } = rows[0];
  if (status === "failed") {
    const re = await db.query(sql.reclaim, [consumer, key, windowSeconds]);
    if (re.rows.length === 1) {
      return { status: "new", attempts: re.rows[0].attempts };
    }
    ({ rows } = await db.query(sql.read, [consumer, key]));
    status = rows[0].status;
    if (status === "failed") {
      throw new Error(`key ${key} is still failed after a concurrent claim`);
    }
  }
  if (status === "processing") {
    throw new Error(`key ${key} is claimed in lease mode; use one mode per consumer`);
  }
  return { status, attempts: rows[0].attempts };
}

// keyOf is middleware.DefaultKey: metadata idempotency_key, else the
// message UUID.
function keyOf(msg) {
  const h = msg.properties.headers || {};
  if (h.idempotency_key !== undefined) {
    return String(h.idempotency_key);
  }
  return String(h._watermill_message_uuid || msg.properties.messageId);
}

async function main() {
  const db = new Client({ connectionString: pgURL });
  await db.connect();
  const conn = await amqp.connect(amqpURL);
  const ch = await conn.createChannel();
  await ch.prefetch(1);
  await ch.checkQueue(queue);
  await ch.consume(queue, async (msg) => {
    const key = keyOf(msg);
    try {
      await db.query("BEGIN");
      const c = await claim(db, key);
      if (c.status !== "new") {
        await db.query("ROLLBACK");
        if (c.status === "dead") {
          await db.query(sql.deadCopy, [consumer, key]);
        }
        ch.ack(msg);
        return;
      }
      // The effect, in the claim's transaction.
      await db.query(
        `INSERT INTO ${effects} (consumer, key, applied) VALUES ($1, $2, 1)
         ON CONFLICT (consumer, key) DO UPDATE SET applied = ${effects}.applied + 1`,
        [consumer, key],
      );
      if (key === failKey && c.attempts === 1) {
        throw new Error("the first attempt fails");
      }
      await db.query("COMMIT");
      process.stdout.write(`committed ${key}\n`);
      ch.ack(msg);
    } catch (err) {
      await db.query("ROLLBACK");
      await db.query(sql.fail, [consumer, key, String(err.message), windowSeconds]);
      ch.nack(msg, false, true);
    }
  });
}

main().catch((err) => {
  process.stderr.write(`consumer: ${err.stack || err}\n`);
  process.exit(1);
});
