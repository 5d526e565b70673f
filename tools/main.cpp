#include <cstdio>
#include <map>

#include "command.h"
#include "epx/error.h"
#include "epx/version.h"

namespace epx::cli {

namespace {
std::multimap<int, Registrar>& registry() {
  static std::multimap<int, Registrar> instance;
  return instance;
}
}  // namespace

bool register_command(int order, Registrar registrar) {
  registry().emplace(order, std::move(registrar));
  return true;
}

}  // namespace epx::cli

int main(int argc, char** argv) {
  using namespace epx::cli;
  CLI::App app{"epx: expert-parallel communication and load balancing for mixture-of-experts models"};
  app.name("epx");
  app.set_version_flag("--version", std::string("epx ") + epx::version() +
                                        (epx::built_with_cuda() ? " (cuda backend)" : " (host backend only)"));
  app.require_subcommand(1);
  for (auto& [order, registrar] : registry()) registrar(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const BadInput& e) {
    std::fprintf(stderr, "epx: %s\n", e.what());
    return kExitBadInput;
  } catch (const epx::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return e.code() == epx::ErrorCode::kInvalidArgument ? kExitBadInput : kExitFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx: %s\n", e.what());
    return kExitFailure;
  }
  return kExitOk;
}
