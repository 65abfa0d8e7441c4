// GPT language-model training end to end on a small periodic text: the validation loss falls far
// below the uniform 8 bits per byte, and a checkpoint reloads to the same validation loss.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "dtrain/data/text.h"
#include "dtrain/train/lm_trainer.h"

using namespace dtrain;
namespace fs = std::filesystem;

TEST(LanguageModel, LearnsPeriodicTextAndCheckpointReloads) {
  fs::path dir = fs::path(DTRAIN_BINARY_DIR) / "test-tmp" / "lm";
  fs::remove_all(dir);
  fs::create_directories(dir / "text");
  {
    std::ofstream out(dir / "text" / "a.txt");
    for (int i = 0; i < 2000; ++i) out << "hello, world! ";
  }
  data::TextConvertOptions topt;
  topt.block_bytes = 1024;
  data::convert_text({(dir / "text").string()}, (dir / "tok").string(), topt);

  train::LmConfig c;
  c.data = (dir / "tok").string();
  c.model.layers = 1;
  c.model.heads = 2;
  c.model.width = 32;
  c.model.context = 16;
  c.batch_size = 8;
  c.steps = 150;
  c.lr = 3e-3f;
  c.min_lr = 3e-4f;
  c.warmup_steps = 10;
  c.eval_every = 0;
  c.eval_batches = 8;
  c.log_every = 0;
  c.quiet = true;
  c.checkpoint_dir = (dir / "ckpt").string();
  train::LmResult r = train::train_lm(c, nullptr);
  EXPECT_LT(r.val_loss, 0.5) << "nats per byte; uniform is ln 256 = 5.55";
  EXPECT_NEAR(r.val_bpb, r.val_loss / std::log(2.0), 1e-9);
  EXPECT_GT(r.tokens_per_s, 0);
  ASSERT_TRUE(fs::exists(r.checkpoint));

  auto model = train::gpt_from_checkpoint(train::load_checkpoint(r.checkpoint));
  EXPECT_EQ(model->config().width, 32);
  double reloaded = train::evaluate_lm(*model, (dir / "tok" / "val.h5").string(), c.batch_size, 16, c.eval_batches);
  EXPECT_NEAR(reloaded, r.val_loss, 1e-6 * std::max(1.0, r.val_loss));
  fs::remove_all(dir);
}
