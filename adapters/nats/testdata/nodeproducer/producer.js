// A JetStream producer that is not Watermill, as a Node service would
// write one with the nats package (nats.js): it publishes the messages
// described by the JSON array in argv[3] to the server at argv[2] and
// prints, per message, one JSON line with the stream's ack.
//
// Each message is {subject, data, msgId?, headers?: [[name, value], ...]}:
// msgId becomes Nats-Msg-Id (the publish option msgID), each header is
// appended as given (a name given twice keeps both values).
"use strict";

const { connect, headers, StringCodec } = require("nats");

async function main() {
  const [server, spec] = process.argv.slice(2);
  const msgs = JSON.parse(spec);
  const nc = await connect({ servers: server });
  const js = nc.jetstream();
  const sc = StringCodec();
  for (const m of msgs) {
    const h = headers();
    for (const [name, value] of m.headers || []) {
      h.append(name, value);
    }
    const opts = { headers: h };
    if (m.msgId) {
      opts.msgID = m.msgId;
    }
    const ack = await js.publish(m.subject, sc.encode(m.data), opts);
    console.log(JSON.stringify({ stream: ack.stream, seq: ack.seq, duplicate: ack.duplicate }));
  }
  await nc.drain();
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
