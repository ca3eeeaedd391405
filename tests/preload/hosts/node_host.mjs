// SPDX-License-Identifier: MIT
// A real third-party host: node-llama-cpp (npm), which loads llama.cpp in a Node addon with
// dlopen and no RTLD_GLOBAL. Loads MODEL, then ROUNDS times: generates greedily, then idles
// IDLE_MS. One JSON line per round: the tokens, VmLck while generating and after the idle.
// Usage: node node_host.mjs NODE_LLAMA_CPP_DIR MODEL ROUNDS IDLE_MS
import fs from "node:fs";
import path from "node:path";
import {pathToFileURL} from "node:url";

const [dir, model_path, rounds_s, idle_ms_s] = process.argv.slice(2);
const {getLlama, LlamaCompletion} = await import(
    pathToFileURL(path.join(dir, "node_modules", "node-llama-cpp", "dist", "index.js")).href);
const vmlck_kb = () => Number(/VmLck:\s+(\d+)/.exec(fs.readFileSync("/proc/self/status", "utf8"))[1]);

const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath: model_path});
const context = await model.createContext({contextSize: 256, threads: 1});
const sequence = context.getSequence();
for (let round = 0; round < Number(rounds_s); ++round) {
  const completion = new LlamaCompletion({contextSequence: sequence});
  const tokens = [];
  let locked_while_generating_kb = 0;
  await completion.generateCompletion("Once upon a time", {
    maxTokens: 6, temperature: 0,
    onToken: (t) => { tokens.push(...t); locked_while_generating_kb = Math.max(locked_while_generating_kb, vmlck_kb()); },
  });
  await sequence.clearHistory();
  await new Promise((resolve) => setTimeout(resolve, Number(idle_ms_s)));
  console.log(JSON.stringify({round, tokens, locked_while_generating_kb, locked_after_idle_kb: vmlck_kb()}));
}
await context.dispose();
await model.dispose();
