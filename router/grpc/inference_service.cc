#include "router/grpc/inference_service.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <mutex>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "numoe/v1/inference.grpc.pb.h"
#include "router/core/errors.h"
#include "router/grpc/connection_gate.h"
#include "router/grpc/generate_request.h"
#include "router/openai/chat.h"

namespace numoe::router {
namespace {

grpc::Status ToGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  std::string param = ParamOf(s);
  std::string msg(s.message());
  // The field name leads the message so clients can tell which one was wrong without a payload.
  if (!param.empty() && msg.rfind(param, 0) != 0 && msg.rfind("'" + param, 0) != 0) msg = absl::StrCat(param, ": ", msg);
  return ToGrpcStatus(Status(s.code(), msg));
}

const char* CodeName(grpc::StatusCode code) {
  static constexpr const char* kNames[] = {"OK",        "CANCELLED",          "UNKNOWN",           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED", "NOT_FOUND",  "ALREADY_EXISTS",    "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",  "OUT_OF_RANGE",
                                           "UNIMPLEMENTED", "INTERNAL",        "UNAVAILABLE",       "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  int i = static_cast<int>(code);
  return (i >= 0 && i < 17) ? kNames[i] : "UNKNOWN";
}

Status CheckAuth(const grpc::CallbackServerContext* ctx, const ApiKeys& keys) {
  if (keys.empty()) return absl::OkStatus();
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  absl::string_view auth = it == md.end() ? absl::string_view() : absl::string_view(it->second.data(), it->second.size());
  return keys.Check(auth, "", "send metadata 'authorization: Bearer <key>'");
}

class GenerateReactor : public grpc::ServerWriteReactor<v1::GenerateResponse>, public ChoiceSink {
 public:
  GenerateReactor(Metrics& metrics) : metrics_(metrics) {}

  // Validates and starts; on error the call is finished at once.
  void Begin(std::shared_ptr<GenerateReactor> self, Frontend& fe, const openai::ChatEncoder& chat,
             const ApiKeys& api_keys, grpc::CallbackServerContext* ctx, const v1::GenerateRequest& req) {
    self_ = std::move(self);
    Status s = Prepare(fe, chat, api_keys, ctx, req);
    if (!s.ok()) {
      FinishWith(s);
      return;
    }
    auto run = fe.Start(std::move(spec_), self_);
    if (!run.ok()) {
      FinishWith(run.status());
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    run_ = *run;
    if (cancelled_) run_->Cancel();
  }

  void OnEvent(ChoiceEvent ev) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    if (ev.final && !ev.status.ok()) {
      final_status_ = ev.status;
      final_pending_ = true;
      MaybeFinishLocked();
      return;
    }
    if (ev.index < 0 || static_cast<size_t>(ev.index) >= choices_.size()) return;
    ChoiceState& c = choices_[static_cast<size_t>(ev.index)];
    v1::GenerateResponse r;
    r.set_index(static_cast<uint32_t>(ev.index));
    r.mutable_token_ids()->Assign(ev.token_ids.begin(), ev.token_ids.end());
    for (const TokenLogprobs& lp : ev.logprobs) {
      v1::TokenLogprobs* out = r.add_logprobs();
      out->set_token_id(lp.chosen.id);
      out->set_token(lp.chosen.token);
      out->set_logprob(lp.chosen.logprob);
      for (const LogprobEntry& t : lp.top) {
        v1::TopLogprob* top = out->add_top_logprobs();
        top->set_token_id(t.id);
        top->set_token(t.token);
        top->set_logprob(t.logprob);
      }
    }
    std::string finish = ev.final ? ev.finish_reason : "";
    if (c.parser) {
      openai::ChatDelta d = c.parser->Add(ev.text);
      if (ev.final) {
        d.Append(c.parser->Finish());
        if (c.parser->tool_calls() > 0 && finish == "stop") finish = "tool_calls";
      }
      r.set_text(d.content);
      r.set_reasoning_text(d.reasoning);
      for (const auto& tc : d.tool_calls) {
        // Streaming deltas -> whole calls: a delta with an id starts one, later ones extend its arguments.
        if (tc.contains("id")) {
          c.tool_calls.emplace_back();
          c.tool_calls.back().set_id(tc["id"].get<std::string>());
        }
        if (c.tool_calls.empty()) continue;
        if (tc.contains("function")) {
          const auto& f = tc["function"];
          if (f.contains("name")) c.tool_calls.back().set_name(f["name"].get<std::string>());
          if (f.contains("arguments")) c.tool_calls.back().mutable_arguments()->append(f["arguments"].get<std::string>());
        }
      }
      if (ev.final) {
        for (auto& call : c.tool_calls) *r.add_tool_calls() = std::move(call);
        c.tool_calls.clear();
      }
    } else {
      r.set_text(std::move(ev.text));
    }
    if (ev.final) {
      r.set_finish_reason(finish);
      r.set_stop_string(ev.stop_string);
      r.mutable_usage()->set_prompt_tokens(ev.prompt_tokens);
      r.mutable_usage()->set_completion_tokens(ev.completion_tokens);
      r.mutable_usage()->set_cached_tokens(ev.cached_tokens);
      if (--open_choices_ == 0) {
        final_pending_ = true;
        final_status_ = absl::OkStatus();
      }
    }
    if (r.token_ids_size() > 0 || !r.text().empty() || !r.reasoning_text().empty() || ev.final) {
      queue_.push_back(std::move(r));
    }
    if (!writing_) WriteNextLocked();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) {  // the client is gone
      CancelLocked();
      return;
    }
    queue_.pop_front();
    WriteNextLocked();
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    CancelLocked();
  }

  void OnDone() override {
    std::shared_ptr<GenerateReactor> keep;
    std::shared_ptr<ChoiceRun> run;
    {
      std::lock_guard<std::mutex> lock(mu_);
      keep = std::move(self_);  // freed when the last reference (a ChoiceRun's sink) goes too
      run = std::move(run_);
    }
    if (run) run->Cancel();  // no-op when it already finished
  }

 private:
  Status Prepare(Frontend& fe, const openai::ChatEncoder& chat, const ApiKeys& api_keys,
                 grpc::CallbackServerContext* ctx, const v1::GenerateRequest& req) {
    RETURN_IF_ERROR(CheckAuth(ctx, api_keys));
    ASSIGN_OR_RETURN(GenerateCall call, PrepareGenerate(fe, chat, req));
    spec_ = std::move(call.spec);
    choices_.resize(static_cast<size_t>(spec_.n));
    for (ChoiceState& c : choices_) {
      if (call.chat) c.parser = std::make_unique<openai::ChatStreamParser>(call.starts_in_reasoning, call.tools);
    }
    open_choices_ = spec_.n;
    return absl::OkStatus();
  }

  void FinishWith(const Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    final_status_ = s;
    final_pending_ = true;
    MaybeFinishLocked();
  }

  void WriteNextLocked() {
    if (finished_) return;
    if (!queue_.empty()) {
      writing_ = true;
      StartWrite(&queue_.front());
      return;
    }
    MaybeFinishLocked();
  }

  void MaybeFinishLocked() {
    if (finished_ || writing_ || !queue_.empty() || !final_pending_) return;
    finished_ = true;
    grpc::Status g = ToGrpc(final_status_);
    metrics_.CountRequest("grpc:Generate", CodeName(g.error_code()));
    Finish(g);
  }

  void CancelLocked() {
    cancelled_ = true;
    if (run_) run_->Cancel();
    if (!finished_ && !writing_) {
      finished_ = true;
      metrics_.CountRequest("grpc:Generate", "CANCELLED");
      Finish(grpc::Status::CANCELLED);
    }
  }

  // One choice's output parsing (chat prompts) and tool calls in progress.
  struct ChoiceState {
    std::unique_ptr<openai::ChatStreamParser> parser;
    std::vector<v1::ToolCall> tool_calls;
  };

  Metrics& metrics_;
  ChoiceSpec spec_;
  std::vector<ChoiceState> choices_;
  int32_t open_choices_ = 1;

  std::mutex mu_;
  std::shared_ptr<GenerateReactor> self_;
  std::shared_ptr<ChoiceRun> run_;
  std::deque<v1::GenerateResponse> queue_;  // front() is being written while writing_
  bool writing_ = false;
  bool final_pending_ = false;
  Status final_status_;
  bool finished_ = false;
  bool cancelled_ = false;
};

class InferenceService final : public v1::Inference::CallbackService {
 public:
  InferenceService(Frontend& fe, const openai::ChatEncoder& chat, Metrics& metrics, ApiKeys api_keys)
      : fe_(fe), chat_(chat), metrics_(metrics), api_keys_(std::move(api_keys)) {}

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* ctx,
                                                           const v1::GenerateRequest* req) override {
    auto r = std::make_shared<GenerateReactor>(metrics_);
    GenerateReactor* raw = r.get();
    raw->Begin(std::move(r), fe_, chat_, api_keys_, ctx, *req);
    return raw;
  }

  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* ctx, const v1::TokenizeRequest* req,
                                     v1::TokenizeResponse* resp) override {
    auto* reactor = ctx->DefaultReactor();
    Status s = CheckAuth(ctx, api_keys_);
    if (s.ok()) {
      auto ids = PrepareTokenize(fe_, *req);
      if (ids.ok()) {
        resp->mutable_token_ids()->Assign(ids->begin(), ids->end());
      } else {
        s = ids.status();
      }
    }
    grpc::Status g = ToGrpc(s);
    metrics_.CountRequest("grpc:Tokenize", CodeName(g.error_code()));
    reactor->Finish(g);
    return reactor;
  }

  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* ctx, const v1::ListModelsRequest*,
                                       v1::ListModelsResponse* resp) override {
    auto* reactor = ctx->DefaultReactor();
    Status s = CheckAuth(ctx, api_keys_);
    if (s.ok()) {
      auto* m = resp->add_models();
      m->set_id(fe_.model().id);
      m->set_vocab_size(static_cast<uint32_t>(fe_.model().vocab_size));
      m->set_max_context(static_cast<uint32_t>(fe_.model().max_context));
    }
    grpc::Status g = ToGrpc(s);
    metrics_.CountRequest("grpc:ListModels", CodeName(g.error_code()));
    reactor->Finish(g);
    return reactor;
  }

 private:
  Frontend& fe_;
  const openai::ChatEncoder& chat_;
  Metrics& metrics_;
  ApiKeys api_keys_;
};

constexpr char kSocketDirPrefix[] = "numoe-router-grpc.";

// The socket directories of routers that died without their shutdown (kill -9): named
// numoe-router-grpc.<pid>.XXXXXX, removed here when that pid is gone and the directory is ours.
void RemoveStaleSocketDirs(const std::filesystem::path& tmp) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(tmp, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kSocketDirPrefix, 0) != 0) continue;
    const std::string rest = name.substr(sizeof(kSocketDirPrefix) - 1);
    const size_t dot = rest.find('.');
    if (dot == std::string::npos || dot == 0) continue;
    int pid = 0;
    struct stat st {};
    if (!absl::SimpleAtoi(rest.substr(0, dot), &pid) || pid <= 0 || pid == getpid() || lstat(entry.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
        st.st_uid != geteuid()) {
      continue;
    }
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to ask about)
    std::error_code rm;
    std::filesystem::remove_all(entry.path(), rm);
  }
}

}  // namespace

struct GrpcServer::Impl {
  GrpcServerOptions options;
  std::unique_ptr<InferenceService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<ConnectionGate> gate;
  // The gRPC server's unix socket is in here (mode 0700): removed at shutdown, or by the next router to start
  // on this machine when this one was killed (RemoveStaleSocketDirs).
  std::string socket_dir;
  int port = 0;

  void RemoveSocketDir() {
    if (socket_dir.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(socket_dir, ec);
    socket_dir.clear();
  }
};

GrpcServer::GrpcServer(Frontend& frontend, const openai::ChatEncoder& chat, Metrics& metrics,
                       GrpcServerOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->service = std::make_unique<InferenceService>(frontend, chat, metrics, impl_->options.api_keys);
}

GrpcServer::~GrpcServer() { Shutdown(0); }

Status GrpcServer::Start() {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  const GrpcServerOptions& o = impl_->options;
  std::error_code fs_error;
  const std::filesystem::path tmp = std::filesystem::temp_directory_path(fs_error);
  if (!fs_error) RemoveStaleSocketDirs(tmp);
  std::string dir = (tmp / absl::StrCat(kSocketDirPrefix, getpid(), ".XXXXXX")).string();
  if (fs_error || mkdtemp(dir.data()) == nullptr) {
    return absl::UnavailableError(absl::StrCat("gRPC: cannot make a directory for its unix socket (", dir, ")"));
  }
  impl_->socket_dir = dir;
  const std::string socket_path = dir + "/grpc.sock";
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (impl_->options.tls.enabled()) {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({impl_->options.tls.private_key, impl_->options.tls.cert_chain});
    credentials = grpc::SslServerCredentials(ssl);
  }
  builder.AddListeningPort("unix:" + socket_path, credentials);
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<size_t>(o.max_message_bytes, INT32_MAX)));
  auto ms = [](double s) { return static_cast<int>(std::min(s * 1000, double{INT32_MAX})); };
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, ms(o.handshake_timeout_s));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, ms(o.idle_timeout_s));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, o.max_concurrent_streams);
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, static_cast<int>(std::min<size_t>(o.max_metadata_bytes, INT32_MAX)));
  builder.RegisterService(impl_->service.get());
  impl_->server = builder.BuildAndStart();
  if (!impl_->server) {
    impl_->RemoveSocketDir();
    return absl::UnavailableError(absl::StrCat("gRPC: cannot listen on ", socket_path));
  }
  impl_->gate = std::make_unique<ConnectionGate>(ConnectionGateOptions{
      .host = o.host, .port = o.port, .max_connections = o.max_connections, .backend_unix_path = socket_path});
  if (Status s = impl_->gate->Start(); !s.ok()) {  // "gRPC: cannot listen on host:port: why"
    impl_->gate.reset();
    Shutdown(0);
    return s;
  }
  impl_->port = impl_->gate->port();
  SetServing(false);
  return absl::OkStatus();
}

int GrpcServer::port() const { return impl_->port; }

void GrpcServer::SetServing(bool serving) {
  if (!impl_->server) return;
  auto* health = impl_->server->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus(serving);
  health->SetServingStatus("numoe.v1.Inference", serving);
}

void GrpcServer::Shutdown(double deadline_s) {
  if (impl_->server) {
    impl_->server->Shutdown(std::chrono::system_clock::now() +
                            std::chrono::milliseconds(static_cast<int64_t>(deadline_s * 1000)));
    impl_->server->Wait();
    impl_->server.reset();
  }
  impl_->gate.reset();  // after the calls ended: their bytes go through it
  impl_->RemoveSocketDir();
}

}  // namespace numoe::router
