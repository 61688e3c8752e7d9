// A Node.js service's writes: each order is a business row and its event
// an outbox row, inserted in one transaction. Every fifth transaction is
// rolled back after both inserts, on purpose: its event must never leave.
//
// Usage: node writer.js DATABASE_URL SCHEMA TOPIC COUNT [WRITERS]
//
// It prints one JSON line per transaction, {"id": …, "committed": bool},
// once the transaction has ended.
'use strict';

const crypto = require('node:crypto');
const { Pool } = require('pg');

async function main() {
  const [url, schema, topic, countArg, writersArg] = process.argv.slice(2);
  const count = Number(countArg);
  const writers = Number(writersArg || 4);
  if (!url || !schema || !topic || !(count > 0) || !(writers > 0)) {
    throw new Error('usage: node writer.js DATABASE_URL SCHEMA TOPIC COUNT [WRITERS]');
  }
  const q = (name) => '"' + schema.replaceAll('"', '""') + '"."' + name + '"';
  const pool = new Pool({ connectionString: url, max: writers });
  const runID = crypto.randomUUID().slice(0, 8);
  let next = 0;

  async function write(i) {
    const id = `order-${runID}-${i}`;
    const commit = i % 5 !== 4;
    const client = await pool.connect();
    try {
      await client.query('BEGIN');
      await client.query(`INSERT INTO ${q('orders')} (id) VALUES ($1)`, [id]);
      // The outbox contract: topic, uuid, partition_key, payload, and
      // metadata as a JSON object of strings. The consumers' inboxes
      // deduplicate on idempotency_key; Kafka partitions on partition_key.
      await client.query(
        `INSERT INTO ${q('outbox')} (topic, uuid, partition_key, payload, metadata) VALUES ($1, $2, $3, $4, $5)`,
        [topic, crypto.randomUUID(), id, Buffer.from(JSON.stringify({ order: id })),
          JSON.stringify({ idempotency_key: id, partition_key: id })]);
      await client.query(commit ? 'COMMIT' : 'ROLLBACK');
    } catch (err) {
      await client.query('ROLLBACK').catch(() => {});
      throw err;
    } finally {
      client.release();
    }
    process.stdout.write(JSON.stringify({ id, committed: commit }) + '\n');
  }

  async function writer() {
    while (next < count) {
      await write(next++);
    }
  }

  try {
    await Promise.all(Array.from({ length: writers }, writer));
  } finally {
    await pool.end();
  }
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
