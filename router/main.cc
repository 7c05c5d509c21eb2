// numoe-router: the front door (gRPC API + OpenAI-compatible REST gateway, tokenizer, load balancing).
#include <cstdlib>

#include "common/args.h"
#include "router/router_app.h"
#include "router/router_flags.h"

int main(int argc, char** argv) {
  numoe::router::RouterAppConfig c;
  if (const char* key = std::getenv("NUMOE_API_KEY")) c.router.api_key = key;
  numoe::ArgParser p("numoe-router",
                     "The front door: gRPC API (numoe.v1.Inference + grpc.health.v1) and an OpenAI-compatible REST\n"
                     "gateway (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) that tokenizes,\n"
                     "applies the DeepSeek V4 chat encoding and balances requests over numoe-worker processes.");
  numoe::router::AddRouterFlags(p, &c);
  p.AddEpilog(
      "\nErrors use OpenAI's JSON: 400 bad field (\"param\" names it; also a prompt past the context or\n"
      "--max-prompt-tokens), 401 API key, 404 unknown model/path, 413 body too large, 431 headers too large,\n"
      "429 queue full (Retry-After), 503 no worker up or too many connections (Retry-After), 504 timeout.\n"
      "Example: numoe-router --model tests/data/tiny-v4 --workers 127.0.0.1:9101,127.0.0.1:9102\n");
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;
  return numoe::router::RunRouterApp(c);
}
