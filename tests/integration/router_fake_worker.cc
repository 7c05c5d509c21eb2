// A fake numoe-worker for the router's integration tests: serves proto/numoe/v1/worker.proto with a
// deterministic output, and can be told to fail.
//
// Output rule: if the decoded prompt contains "REPLY:", the reply is the text after it up to the next
// <｜Assistant｜>, <｜User｜> or EOS, with "[/think]" replaced by "</think>" (special tokens in it are recognised, so a test can script
// reasoning or a DSML tool block);
// otherwise the prompt ids are echoed (leading BOS skipped), cyclically, until max_new_tokens. EOS (or a
// stop_token_id) ends the sequence with "stop" unless ignore_eos; running out of a REPLY ends it with "stop"
// after the EOS id; max_new_tokens ends it with "length".
//
// Failure knobs: --fail-first N (the first N Generate calls fail with UNAVAILABLE before any token),
// --die-after-tokens K (the process exits abruptly once K tokens were sent in total), --token-delay-ms.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <memory>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "common/args.h"
#include "common/tokenizer/tokenizer.h"
#include "numoe/v1/worker.grpc.pb.h"

namespace {

using numoe::v1::WorkerGenerateRequest;
using numoe::v1::WorkerGenerateResponse;

struct Options {
  std::string model;
  std::string id = "fake";
  int64_t token_delay_ms = 0;
  int64_t fail_first = 0;
  int64_t die_after_tokens = -1;
  int64_t max_sequences = 4;
};

class FakeWorker final : public numoe::v1::Worker::Service {
 public:
  FakeWorker(Options o, std::unique_ptr<numoe::tokenizer::Tokenizer> tok) : o_(std::move(o)), tok_(std::move(tok)) {}

  grpc::Status Generate(grpc::ServerContext* ctx, const WorkerGenerateRequest* req,
                        grpc::ServerWriter<WorkerGenerateResponse>* writer) override {
    if (calls_.fetch_add(1) < o_.fail_first) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake: told to fail");
    if (req->prompt_ids_size() == 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "prompt_ids is empty");
    active_.fetch_add(1);
    prompt_tokens_.fetch_add(req->prompt_ids_size());
    std::vector<int32_t> out = Output(*req);
    const int32_t eos = tok_->special_ids().eos;
    std::string finish = "length";
    for (uint32_t i = 0; i < req->max_new_tokens(); ++i) {
      if (ctx->IsCancelled()) break;
      if (o_.token_delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o_.token_delay_ms));
      int32_t id = out[i % out.size()];
      WorkerGenerateResponse r;
      r.add_token_ids(id);
      bool stop = !req->ignore_eos() && id == eos;
      for (int32_t s : req->stop_token_ids()) stop |= id == s;
      if (stop) {
        finish = "stop";
        r.set_finish_reason(finish);
      } else if (i + 1 == req->max_new_tokens()) {
        r.set_finish_reason("length");
      }
      if (!writer->Write(r)) break;
      generated_.fetch_add(1);
      if (o_.die_after_tokens >= 0 && generated_.load() >= o_.die_after_tokens) {
        std::fprintf(stderr, "fake worker %s: dying after %lld tokens\n", o_.id.c_str(),
                     static_cast<long long>(generated_.load()));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let the tokens reach the router first
        _exit(3);
      }
      if (stop) break;
    }
    active_.fetch_sub(1);
    return grpc::Status::OK;
  }

  grpc::Status Stats(grpc::ServerContext*, const numoe::v1::WorkerStatsRequest*,
                     numoe::v1::WorkerStats* s) override {
    s->set_worker_id(o_.id);
    s->set_active_sequences(static_cast<uint32_t>(active_.load()));
    s->set_queued_sequences(0);
    s->set_max_sequences(static_cast<uint32_t>(o_.max_sequences));
    s->set_tokens_generated(generated_.load());
    s->set_prompt_tokens(prompt_tokens_.load());
    return grpc::Status::OK;
  }

 private:
  std::vector<int32_t> Output(const WorkerGenerateRequest& req) {
    std::vector<int32_t> prompt(req.prompt_ids().begin(), req.prompt_ids().end());
    std::string text = tok_->Decode(prompt);
    size_t at = text.find("REPLY:");
    if (at != std::string::npos) {
      std::string reply = text.substr(at + 6);
      for (const char* end : {"<｜Assistant｜>", "<｜User｜>", "<｜end▁of▁sentence｜>"}) reply = reply.substr(0, reply.find(end));
      // Clients may not type special tokens: the script spells </think> as [/think].
      for (size_t p; (p = reply.find("[/think]")) != std::string::npos;) reply.replace(p, 8, "</think>");
      auto ids = tok_->Encode(reply);
      if (ids.ok()) {
        std::vector<int32_t> out = *ids;
        out.push_back(tok_->special_ids().eos);
        return out;
      }
    }
    if (prompt.size() > 1 && prompt.front() == tok_->special_ids().bos) prompt.erase(prompt.begin());
    return prompt;
  }

  Options o_;
  std::unique_ptr<numoe::tokenizer::Tokenizer> tok_;
  std::atomic<int64_t> calls_{0};
  std::atomic<int64_t> active_{0};
  std::atomic<int64_t> generated_{0};
  std::atomic<int64_t> prompt_tokens_{0};
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  int64_t port = 0;
  std::string ready_file;
  std::string host = "127.0.0.1";
  numoe::ArgParser p("router_fake_worker", "A fake numoe-worker for the router tests (see the source header).");
  p.AddString("model", "DIR", "model directory (for tokenizer.json)", &o.model, true);
  p.AddString("host", "ADDR", "address to listen on (loopback: any 127.x.y.z, so a test can have several hosts)",
              &host);
  p.AddInt("port", "N", "port on --host (0 = any)", &port, 0, 65535);
  p.AddString("id", "NAME", "worker_id reported by Stats", &o.id);
  p.AddString("ready-file", "PATH", "write the bound port here once serving", &ready_file);
  p.AddInt("token-delay-ms", "MS", "sleep before each token", &o.token_delay_ms, 0, 100000);
  p.AddInt("fail-first", "N", "the first N Generate calls fail with UNAVAILABLE", &o.fail_first, 0, 1 << 30);
  p.AddInt("die-after-tokens", "K", "exit abruptly after K tokens in total (-1 = never)", &o.die_after_tokens, -1,
           1 << 30);
  p.AddInt("max-sequences", "N", "max_sequences reported by Stats", &o.max_sequences, 0, 1 << 20);
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;
  auto tok = numoe::tokenizer::Tokenizer::Load(o.model);
  if (!tok.ok()) {
    std::fprintf(stderr, "fake worker: %s\n", std::string(tok.status().message()).c_str());
    return 1;
  }
  // Blocked before gRPC starts its threads, so only sigwait below receives them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  FakeWorker service(o, std::move(*tok));
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a taken port fails, as the real daemons do
  builder.AddListeningPort(host + ":" + std::to_string(port), grpc::InsecureServerCredentials(), &bound);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  if (!server || bound == 0) {
    std::fprintf(stderr, "fake worker: cannot listen on port %lld\n", static_cast<long long>(port));
    return 1;
  }
  if (!ready_file.empty()) {
    std::ofstream(ready_file + ".tmp") << bound << "\n";
    std::rename((ready_file + ".tmp").c_str(), ready_file.c_str());
  }
  std::fprintf(stderr, "fake worker %s listening on 127.0.0.1:%d\n", o.id.c_str(), bound);
  int sig = 0;
  sigwait(&set, &sig);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  return 0;
}
