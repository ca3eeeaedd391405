// SPDX-License-Identifier: MIT
// llama-server as a user runs it, for the tests that talk to it over HTTP: started on a free
// local port with a model, waited for until /health answers 200, asked with plain HTTP/1.1
// requests (no client library: one connection per request, "Connection: close"). The process is
// a ChildProcess, killed and reaped when the test ends however it ends.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "support/child_process.hpp"

namespace residency::testing {

struct HttpReply {
  int status = 0;  // 0: no answer (connection refused, reset or timed out)
  std::string body;
};

// A port on 127.0.0.1 that nothing listens on now (the kernel's choice for port 0, then closed):
// another process could take it before llama-server binds, which start_llama_server reports.
inline int free_local_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

// One request to 127.0.0.1:port; `body` empty: GET, else POST with a JSON body.
inline HttpReply http_request(int port, const std::string& path, const std::string& body = "", double timeout_s = 120) {
  HttpReply r;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return r;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return r;
  }
  std::string req = (body.empty() ? "GET " : "POST ") + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  if (!body.empty()) req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  req += "\r\n" + body;
  for (std::size_t off = 0; off < req.size();) {
    const ssize_t n = ::send(fd, req.data() + off, req.size() - off, MSG_NOSIGNAL);
    if (n <= 0) {
      ::close(fd);
      return r;
    }
    off += static_cast<std::size_t>(n);
  }
  std::string reply;
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const double left = timeout_s - std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left * 1000) + 1) <= 0) break;
    char chunk[4096];
    const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
    if (n <= 0) break;
    reply.append(chunk, static_cast<std::size_t>(n));
  }
  ::close(fd);
  // "HTTP/1.1 200 OK\r\n...\r\n\r\nBODY" (llama-server sends Content-Length, not chunks, for
  // non-streamed answers).
  if (reply.rfind("HTTP/1.", 0) != 0 || reply.size() < 12) return r;
  r.status = std::atoi(reply.c_str() + 9);
  if (const auto end = reply.find("\r\n\r\n"); end != std::string::npos) r.body = reply.substr(end + 4);
  return r;
}

// A JSON string literal of `s`, escaped as llama-server (nlohmann::json) writes one: quotes,
// backslashes, \b \f \n \r \t by name, other control characters as \u00XX.
inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    const char* named = c == '\b'   ? "\\b"
                        : c == '\f' ? "\\f"
                        : c == '\n' ? "\\n"
                        : c == '\r' ? "\\r"
                        : c == '\t' ? "\\t"
                                    : nullptr;
    if (named != nullptr) {
      out += named;
    } else if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\u00";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// The number after "key": in a flat JSON answer, or nullopt.
inline std::optional<long long> json_number(const std::string& json, const std::string& key) {
  const auto k = json.find("\"" + key + "\":");
  if (k == std::string::npos) return std::nullopt;
  std::size_t p = k + key.size() + 3;
  while (p < json.size() && json[p] == ' ') ++p;
  if (p >= json.size() || (json[p] != '-' && (json[p] < '0' || json[p] > '9'))) return std::nullopt;
  return std::atoll(json.c_str() + p);
}

// llama-server on `model` (CPU only, 2 threads, a small context), plus `extra` arguments; `env`
// as in ChildSpec. Returns the running server once /health answers 200, or nullptr with `error`
// saying why (it exited, or did not become healthy in `timeout_s`; its stderr is in error).
struct LlamaServer {
  std::unique_ptr<ChildProcess> process;
  int port = 0;
  std::string stderr_path;
};
inline std::optional<LlamaServer> start_llama_server(const std::string& server_path, const std::string& model,
                                                     const std::string& stderr_path, std::string& error,
                                                     std::vector<std::string> extra = {},
                                                     std::vector<std::string> env = {},
                                                     std::vector<std::string> drop_env_prefixes = {},
                                                     double timeout_s = 120) {
  LlamaServer s;
  s.port = free_local_port();
  s.stderr_path = stderr_path;
  ChildSpec spec;
  spec.argv = {server_path, "-m",  model, "--host", "127.0.0.1", "--port",    std::to_string(s.port), "-t", "2", "-c",
               "256",       "-np", "1",   "-ngl",   "0",         "--no-webui"};
  spec.argv.insert(spec.argv.end(), extra.begin(), extra.end());
  spec.env = std::move(env);
  spec.drop_env_prefixes = std::move(drop_env_prefixes);
  spec.stderr_path = stderr_path;
  s.process = std::make_unique<ChildProcess>(spec);
  if (!s.process->started()) {
    error = "cannot start " + server_path;
    return std::nullopt;
  }
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s) {
    if (!s.process->alive()) {
      error = "llama-server exited before it was ready:\n" + s.process->stderr_text();
      return std::nullopt;
    }
    if (http_request(s.port, "/health", "", 5).status == 200) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  error = "llama-server did not answer /health with 200 in " + std::to_string(timeout_s) + " s:\n" +
          s.process->stderr_text();
  return std::nullopt;
}

}  // namespace residency::testing
