// SPDX-License-Identifier: MIT
// Parses a GGUF file with @huggingface/gguf (a parser nobody on this project wrote) and compares
// what it finds with what our reader found, given as JSON. Exit 0: identical; 1: differences
// (listed); 2: usage or parse failure.
//   node gguf_compare.mjs MODEL.gguf EXPECTED.json
import { readFileSync } from "node:fs";
import { gguf } from "@huggingface/gguf";

const [model, expectedPath] = process.argv.slice(2);
if (!model || !expectedPath) {
  console.error("usage: node gguf_compare.mjs MODEL.gguf EXPECTED.json");
  process.exit(2);
}
const expected = JSON.parse(readFileSync(expectedPath, "utf8"));
let parsed;
try {
  parsed = await gguf(model, { allowLocalFile: true });
} catch (e) {
  console.error(`@huggingface/gguf could not parse ${model}: ${e.message}`);
  process.exit(2);
}
const { metadata, tensorInfos, tensorDataOffset } = parsed;
const problems = [];
// Numbers we send as JSON numbers (floats) are compared as numbers; integers come as strings
// (64-bit values do not fit a JS number) and are compared with the BigInt or number they parse to.
const same = (what, ours, theirs) => {
  const equal = typeof ours === "number" ? ours === Number(theirs) : String(ours) === String(theirs);
  if (!equal) problems.push(`${what}: ours ${ours}, @huggingface/gguf ${theirs}`);
};

same("version", expected.version, metadata.version);
same("tensor count", expected.tensors.length, tensorInfos.length);
same("data offset", expected.data_offset, tensorDataOffset);
expected.tensors.forEach((t, i) => {
  const o = tensorInfos[i];
  if (!o) return;
  same(`tensor ${i} name`, t.name, o.name);
  same(`tensor ${t.name} type`, t.type, o.dtype);
  same(`tensor ${t.name} shape`, t.shape.join(","), o.shape.map(String).join(","));
  same(`tensor ${t.name} offset`, t.offset, o.offset);
});
for (const [key, v] of Object.entries(expected.metadata)) {
  if (!(key in metadata)) {
    problems.push(`metadata ${key}: missing in @huggingface/gguf's result`);
    continue;
  }
  const theirs = metadata[key];
  if (v.count !== undefined) {
    same(`metadata ${key} length`, v.count, theirs.length);
    if (v.first !== undefined && theirs.length > 0) same(`metadata ${key}[0]`, v.first, theirs[0]);
  } else {
    same(`metadata ${key}`, v.value, typeof theirs === "boolean" ? Number(theirs) : theirs);
  }
}
if (problems.length) {
  console.log(problems.join("\n"));
  process.exit(1);
}
console.log(`${model}: ${tensorInfos.length} tensors and ${Object.keys(expected.metadata).length} metadata values agree`);
