// forkline from Node.js: Info + Tokenize on the engine, then two gateway rounds on the prefix service.
//
//   node client.js ENGINE_ADDR PREFIX_ADDR [PROMPT]
//
// Prints one JSON line per round: {"round", "reused", "prompt", "tokens", "text", "finish"}.
// The protos are loaded at run time from ../../../protos (no generated JS code).
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_DIR = path.resolve(__dirname, "..", "..", "..", "protos");
const OWNER = new grpc.Metadata();
OWNER.set("forkline-owner", "node-example");

function load() {
  const definition = protoLoader.loadSync(["engine.proto", "prefix.proto"], {
    includeDirs: [PROTO_DIR],
    keepCase: true,
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).forkline;
}

function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, OWNER, (err, reply) => (err ? reject(err) : resolve(reply)));
  });
}

function generate(prefix, prompt, round) {
  return new Promise((resolve, reject) => {
    const result = { round, reused: 0, prompt: 0, tokens: [], text: "", finish: null };
    const call = prefix.Generate(
      { namespace: "node", tokens: { ids: prompt }, config: { max_new_tokens: 8 } },
      OWNER,
    );
    call.on("data", (event) => {
      if (event.event === "tokens") {
        result.tokens.push(...event.tokens.ids);
        result.text += event.tokens.text;
      } else if (event.event === "done") {
        result.reused = event.done.reused_positions;
        result.prompt = event.done.prompt_positions + event.done.reused_positions;
        result.finish = event.done.finish_reason;
      }
    });
    call.on("error", reject);
    call.on("end", () => resolve(result));
  });
}

async function main() {
  const [engineAddr, prefixAddr, text = "The quick brown fox jumps over the lazy dog."] = process.argv.slice(2);
  if (!engineAddr || !prefixAddr) {
    console.error("usage: node client.js ENGINE_ADDR PREFIX_ADDR [PROMPT]");
    process.exit(2);
  }
  const forkline = load();
  const creds = grpc.credentials.createInsecure();
  const engine = new forkline.engine.v1.Engine(engineAddr, creds);
  const prefix = new forkline.prefix.v1.PrefixCache(prefixAddr, creds);
  const info = await unary(engine, "Info", {});
  console.log(JSON.stringify({ model: info.model, instance_id: info.instance_id, cache_kind: info.cache_kind }));
  const tokenized = await unary(engine, "Tokenize", { text: { text, add_special_tokens: true } });
  for (let round = 1; round <= 2; round++) {
    console.log(JSON.stringify(await generate(prefix, tokenized.ids, round)));
  }
  // engine.close() would be the Close RPC (grpc-js adds lowercase aliases): close the channels
  engine.getChannel().close();
  prefix.getChannel().close();
}

main().catch((err) => {
  console.error(`error: ${err.code} ${err.details || err.message}`);
  process.exit(1);
});
